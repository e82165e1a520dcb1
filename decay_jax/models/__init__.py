"""Flax models and their building blocks: layers, decay schedules, MAE, SiT, routing, VAE, Inception."""

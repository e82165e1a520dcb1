"""Model conversion from the official PyTorch checkpoints and external models (VAE, Inception)."""

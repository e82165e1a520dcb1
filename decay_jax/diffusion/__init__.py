"""Flow-matching transport (paths, losses) and the ODE/SDE samplers of SiT."""

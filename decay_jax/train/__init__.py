"""The trainer and what it needs: configs, tasks, optimiser, jitted step, checkpoints, writers."""

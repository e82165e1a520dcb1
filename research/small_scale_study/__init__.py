"""The small-scale study: when do decayed shortcuts help? (README.md here; run with ``python -m research.small_scale_study.run``)."""

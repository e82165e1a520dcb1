"""Representation evaluators (KNN, linear probes, per-block probes, rank), the suite, reports and generation metrics."""

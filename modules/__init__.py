"""The library: data, models, the one training step and loop, measuring, results and reports.

Knows nothing of Optuna or notebooks (ARCHITECTURE.md)."""

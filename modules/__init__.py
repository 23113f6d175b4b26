"""The library: data, models, the one training step and loop, measuring, results and reports.

Knows nothing of Optuna or notebooks: the tuners and the notebook call into it, never the
other way (README.md, "Layout")."""

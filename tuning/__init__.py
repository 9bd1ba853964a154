"""Optuna integration for raysim runs. See issue 4."""

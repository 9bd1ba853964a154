"""Federated learning methods for raysim, one module per method (registered by name in raysim/shipped.py,
reached through raysim.config.registry)."""

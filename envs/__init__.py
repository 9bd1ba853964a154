"""Environment layer (device heterogeneity, network, participation, simulated clock). See issue 3."""

"""The application: what the ``raysim`` command does with the engine — the command line (:mod:`raysim.app.cli`),
seed sweeps (:mod:`raysim.app.sweep`), seed reproductions and their tables and verdicts
(:mod:`raysim.app.seed_experiments`, :mod:`raysim.app.reproduction_table`, :mod:`raysim.app.verdicts`) and the summary of
finished runs that ``raysim report`` writes (:mod:`raysim.app.summary`). It sits on top: nothing in the contract, the config plumbing, the engine or the backends
imports it (tests/test_layers.py); ``import raysim`` does not load it."""

"""raysim: a Ray-based simulation engine for heterogeneous federated learning.

The public API: :func:`run_experiment`, :func:`load_config` / :func:`make_config`, :class:`Callback`, the errors,
the registrations and the marks a config's import paths need (``dataset_loader``, ``model_factory``), and
``raysim.results`` (the pandas helpers over result tables; the module lives in
``raysim/io/results.py`` and is reachable as ``raysim.results`` too, as it always was)."""

from raysim import numerics as _numerics

_numerics.pin_at_import()  # before anything computes: the portable kernels (backend.numerics, raysim/numerics.py)

from raysim.config import ExperimentConfig, load_config, make_config
from raysim.errors import ConfigError, DataError, SimulationError
from raysim.config.registry import dataset_loader, model_factory, register_algorithm
from raysim._version import __version__
from raysim import shipped as _shipped

_shipped.register()  # the shipped methods, backends and environment, by name (raysim/shipped.py)


def run_experiment(cfg, **kwargs):
    """:func:`raysim.engine.loop.run_experiment`: the config, then keywords only (out_dir, progress, write, resume,
    callbacks, prepared)."""
    from raysim.engine.loop import run_experiment as _run

    return _run(cfg, **kwargs)


def __getattr__(name):
    if name == "results":  # raysim/io/results.py (pandas, loaded on first use: a Ray worker never needs it);
        # ``import raysim.results`` reaches the same module through raysim/results.py
        from raysim.io import results

        return results
    if name == "register_dataset":  # torch-free until used: `import raysim` loads no torch (a Ray task that only
        # reads a node's CPU, the CLI's early errors)
        from raysim.data.datasets import register_dataset

        return register_dataset
    if name == "register_model":
        from raysim.models import register_model

        return register_model
    if name == "Callback":  # the driver's callback base class (imported lazily: torch stays unimported until needed)
        from raysim.engine.callbacks import Callback

        return Callback
    raise AttributeError(name)


__all__ = ["Callback", "ConfigError", "DataError", "ExperimentConfig", "SimulationError", "dataset_loader",
           "load_config", "make_config", "model_factory", "results", "register_algorithm", "register_dataset",
           "register_model", "run_experiment", "__version__"]

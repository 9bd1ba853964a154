"""raysim: a Ray-based simulation engine for heterogeneous federated learning."""
from raysim.config import ConfigError, ExperimentConfig, load_config, make_config
from raysim.data.datasets import DataError
from raysim.registry import register_algorithm, register_dataset, register_model
from raysim.errors import SimulationError

__version__ = "0.1.0"


def run_experiment(*args, **kwargs):
    from raysim.driver import run_experiment as _run

    return _run(*args, **kwargs)


def __getattr__(name):
    if name == "Callback":  # the driver's callback base class (imported lazily: torch stays unimported until needed)
        from raysim.driver import Callback

        return Callback
    raise AttributeError(name)


__all__ = ["Callback", "ConfigError", "DataError", "ExperimentConfig", "SimulationError", "load_config", "make_config",
           "register_algorithm", "register_dataset", "register_model", "run_experiment", "__version__"]

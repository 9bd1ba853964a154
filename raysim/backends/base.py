"""The backend interface (:mod:`raysim.engine.backend`), where the backends find it."""
from raysim.engine.backend import Backend, run_state_dir

__all__ = ["Backend", "run_state_dir"]

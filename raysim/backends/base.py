"""The backend interface (:mod:`raysim.engine.backend`), where the backends find it."""
from raysim.engine.backend import NO_FOLLOW, Backend, BackendReport, Follow, NextServerStep, run_state_dir

__all__ = ["NO_FOLLOW", "Backend", "BackendReport", "Follow", "NextServerStep", "run_state_dir"]

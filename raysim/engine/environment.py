"""What the engine asks of a simulated environment (device speeds, network, participation, a simulated clock): the
declared protocol the round loop, the preparation and the checkpoints call, and nothing else. The implementation
shipped with raysim is ``envs.Environment`` (the ``env`` config section; the environment layer imports raysim, never
the reverse); it is reached through the registry (:func:`raysim.config.registry.make_environment`,
:func:`raysim.config.registry.register_environment` for another one), and whatever it builds is checked against this
protocol before a run starts."""
from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

from raysim.errors import ConfigError


@runtime_checkable
class RoundOutcome(Protocol):
    """Who delivered in a round: ``keep`` (client ids whose uploads reach the server), ``failures()`` ((client id,
    reason) of the dropped and late ones), ``rows()`` (result rows: round, client, scope, metric, value, weight)."""

    keep: list

    def failures(self) -> list: ...

    def rows(self): ...


@runtime_checkable
class Environment(Protocol):
    """The simulated environment of a run, as the engine uses it."""

    sim_time: float  # the simulated clock (seconds), shown by the progress bar

    def archs(self, model_cfg) -> list: ...  # each client's architecture (model.assign: tier)

    def bind(self, task) -> None: ...  # the task (architectures, sizes) known: compute times can be estimated

    def select(self, round_idx: int, target: Optional[int] = None) -> list: ...  # the round's sampled clients

    def outcome(self, round_idx: int, reports: list) -> RoundOutcome: ...  # after a round's first client step

    def summary(self) -> dict: ...  # the run's metadata entry

    def state_dict(self) -> dict: ...  # checkpointed with the driver's state

    def load_state_dict(self, state: dict) -> None: ...


def check_environment(env) -> None:
    """A built environment must provide every method the engine calls (one ConfigError naming ``env``)."""
    if env is not None and not isinstance(env, Environment):
        missing = [m for m in ("archs", "bind", "select", "outcome", "summary", "state_dict", "load_state_dict",
                               "sim_time") if not hasattr(env, m)]
        raise ConfigError("env", f"the environment {type(env).__qualname__} lacks {', '.join(missing)} "
                                 f"(raysim.engine.environment.Environment)")

"""The typed settings each layer reads, built once from the config when a run is prepared (:func:`runner_settings`,
:func:`backend_settings`): the config itself stays on the driver. A runner (client or server, in any process) gets
:class:`RunnerSettings` in its :class:`~raysim.runner.runners.RunSpec`; a backend gets :class:`BackendSettings`
beside the spec; the environment gets its own section when it is made (``envs``); the data section travels only to
the client actors that build their clients' data themselves (``RunSpec.data``)."""
from __future__ import annotations

from dataclasses import dataclass

from raysim.config import BackendConfig, ExperimentConfig
from raysim.runner.settings import RunnerSettings  # noqa: F401 (re-exported: built here)


@dataclass(frozen=True)
class BackendSettings:
    """What a backend reads: its own config section and the facts of the run it needs to lay out, place and look
    after its runners."""

    backend: BackendConfig
    run_name: str  # the prefix of the run's state directory
    num_clients: int
    archs: tuple  # the architectures the clients train (model.arch or model.per_client's), each once, in order
    on_actor_failure: str  # retry | skip | stop
    max_retries: int


def runner_settings(cfg: ExperimentConfig) -> RunnerSettings:
    b = cfg.backend
    return RunnerSettings(cfg.seed, b.device, b.numerics, b.torch_threads, cfg.vectorizes(), b.decoded_cache_mb,
                          b.state_memory_mb, int(b.max_group))


def backend_settings(cfg: ExperimentConfig) -> BackendSettings:
    archs = [cfg.model.arch] if cfg.model.per_client is None else [a.arch for a in cfg.model.per_client]
    return BackendSettings(cfg.backend, cfg.name, cfg.data.num_clients, tuple(dict.fromkeys(archs)),
                           cfg.on_actor_failure, cfg.max_retries)

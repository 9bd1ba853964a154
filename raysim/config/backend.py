"""The ``backend`` section: where and how the clients run (sequential or Ray, actors, devices, kernels, the state
store), with its ``model_resources`` entries (:class:`ModelResources`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from raysim.errors import ConfigError
from raysim.config.fields import _p, choice, positive


@dataclass(frozen=True)
class BackendConfig:
    name: str = "sequential"
    num_actors: int = 2
    num_cpus: float = 1.0  # per client actor
    num_gpus: float = 0.0  # per client actor, fractional allowed (0.25 -> four actors per GPU)
    server_num_cpus: float = 0.0
    server_num_gpus: float = 0.0
    address: Optional[str] = None  # an existing Ray cluster; None starts a local one
    connect_timeout_s: float = 10.0  # how long backend.address may take to answer before the run stops (one line)
    step_timeout_s: float = 0.0  # Ray: a client actor whose call of a step runs longer is taken for dead (a stopped
    #                              or hung process): replaced and retried per on_actor_failure, one line beyond
    #                              max_retries; 0: no limit
    torch_threads: int = 1  # intra-op threads per worker (1 keeps results bit-identical across backends)
    device: str = "auto"  # auto (cuda if available) | cpu | cuda
    state_memory_mb: float = 1024.0  # client states kept in memory per actor; beyond it the least recently used spill
    decoded_cache_mb: float = 256.0  # per client runner: float copies of compact (uint8) client data kept between
    #                                  steps (a multi-exchange round reads each client several times); 0: decode per step
    state_dir: Optional[str] = None  # where states spill (None: a temporary directory, removed at the end)
    placement: str = "default"  # Ray: default (Ray packs actors) | spread (client actors over the cluster's nodes)
    data: str = "auto"  # Ray: where client data is built: driver (shipped to actors) | actors (each actor loads its
    #                     clients from the config on its own node) | auto (actors when backend.address is set)
    balance: str = "cost"  # Ray: which actor runs a client: static (client i on actor i % n) | cost (each training
    #                          step's clients placed by predicted cost, corrected online from measured step times)
    numerics: str = "portable"  # portable: one kernel choice on every CPU with AVX2 (the same table on any machine) |
    #                             native: torch's fastest kernels for each CPU (raysim/numerics.py); part of the identity
    vectorize: Any = "auto"  # train the clients of one architecture in a step together (the batched executor):
    #   true | false | auto (the default: on where the clients train on a GPU, the per-client loop on a CPU except
    #   for a method whose group forms are its CPU default too, Algorithm.vectorize_on_cpu: MAFML); on, it changes the
    #   numbers within a stated tolerance, so it is part of the run's identity (ExperimentConfig.vectorizes())
    max_group: int = 0  # vectorised executor: at most this many clients trained as one batched group (0: as many as
    #                     the step has, on a GPU as many as the runner's free memory holds by the footprint estimate)
    partial_aggregate: Any = "auto"  # each client runner merges its clients' uploads into one (a partial aggregate)
    #   when the method's server step declares a merge: one message per actor instead of one per client. auto: only
    #   with one client runner (sequential, Ray with one actor), where the merged upload is exactly what the server
    #   would compute (same table); true: with any number of actors (their sums grouped differently: numbers within
    #   the stated tolerance, so part of the run's identity); false: never (the server sees every client's upload)
    # Ray: per-architecture actor pools ([{arch, num_actors, num_cpus, num_gpus, gpu_memory_mb}]): the clients of
    # each listed architecture run on actors of their own shape; the others on the num_actors default actors
    model_resources: Optional[list[ModelResources]] = None
    code: Any = "auto"  # Ray: the user code shipped to every actor: auto (the modules the config's import paths and
    #                     registrations load from outside installed packages, with their sibling modules), none,
    #                     working_dir (the whole working directory as Ray's working_dir), or a list of module files /
    #                     package directories (Ray py_modules)

    def clients_on_gpu(self) -> bool:
        """Whether the clients train on a GPU: ``device: cuda``; with ``device: auto`` a run in a process that sees
        CUDA (sequential), a Ray run whose client actors hold a GPU share on this machine when it has CUDA or on a
        cluster (``address``: the driver need not have a GPU itself; a local Ray with fake GPUs trains on the CPU)."""
        if self.device != "auto":
            return self.device == "cuda"
        if self.name == "ray" and not (self.num_gpus > 0 or any(r.num_gpus > 0 for r in self.model_resources or [])):
            return False
        if self.name == "ray" and self.address:
            return True
        import torch

        return torch.cuda.is_available()

    def vectorizes(self) -> bool:
        """``vectorize`` resolved: true or false as set; auto: on where the clients train on a GPU (the batched
        executor is the GPU's fast path), off on a CPU (the per-client loop is the reference, as fast there)."""
        return self.clients_on_gpu() if self.vectorize == "auto" else bool(self.vectorize)

    def check(self, path: str) -> None:
        choice(_p(path, "name"), self.name, ["sequential", "ray"])
        positive(_p(path, "state_memory_mb"), self.state_memory_mb, allow_zero=True)
        positive(_p(path, "decoded_cache_mb"), self.decoded_cache_mb, allow_zero=True)
        choice(_p(path, "placement"), self.placement, ["default", "spread"])
        choice(_p(path, "data"), self.data, ["auto", "driver", "actors"])
        choice(_p(path, "balance"), self.balance, ["static", "cost"])
        positive(_p(path, "num_actors"), self.num_actors)
        positive(_p(path, "num_cpus"), self.num_cpus, allow_zero=True)
        positive(_p(path, "num_gpus"), self.num_gpus, allow_zero=True)
        positive(_p(path, "server_num_cpus"), self.server_num_cpus, allow_zero=True)
        positive(_p(path, "server_num_gpus"), self.server_num_gpus, allow_zero=True)
        positive(_p(path, "torch_threads"), self.torch_threads)
        if isinstance(self.max_group, bool) or not isinstance(self.max_group, int) or self.max_group < 0:
            raise ConfigError(_p(path, "max_group"), f"must be an integer >= 0 (0: no limit), got {self.max_group!r}")
        positive(_p(path, "connect_timeout_s"), self.connect_timeout_s)
        positive(_p(path, "step_timeout_s"), self.step_timeout_s, allow_zero=True)
        if self.address is not None and not str(self.address).strip():
            raise ConfigError(_p(path, "address"), "is empty; give host:port of a running Ray head (or leave it out "
                                                   "to start a local cluster)")
        choice(_p(path, "device"), self.device, ["auto", "cpu", "cuda"])
        choice(_p(path, "numerics"), self.numerics, ["portable", "native"])
        if not (isinstance(self.vectorize, bool) or self.vectorize == "auto"):  # 1 is not true
            raise ConfigError(_p(path, "vectorize"), f"must be auto, true or false, got {self.vectorize!r}")
        if not (isinstance(self.partial_aggregate, bool) or self.partial_aggregate == "auto"):  # 1 is not true
            raise ConfigError(_p(path, "partial_aggregate"), f"must be auto, true or false, got "
                                                             f"{self.partial_aggregate!r}")
        if isinstance(self.code, str):
            if self.code not in ("auto", "none", "working_dir"):
                raise ConfigError(_p(path, "code"), f"{self.code!r} is not allowed; choose one of: auto, none, "
                                                    f"working_dir, or a list of module files / package directories")
        elif not (isinstance(self.code, (list, tuple)) and all(isinstance(c, str) and c for c in self.code)):
            raise ConfigError(_p(path, "code"), f"must be auto, none, working_dir or a list of module files / package "
                                                f"directories, got {self.code!r}")
        for name in ("num_gpus", "server_num_gpus"):
            v = getattr(self, name)
            if v > 1 and not float(v).is_integer():
                raise ConfigError(_p(path, name), f"a fraction must be <= 1, or a whole number of GPUs; got {v}")
        seen = set()
        for i, r in enumerate(self.model_resources or []):
            r.check(_p(path, f"model_resources[{i}]"))
            if r.arch in seen:
                raise ConfigError(_p(path, f"model_resources[{i}].arch"), f"{r.arch!r} is listed twice")
            seen.add(r.arch)


@dataclass(frozen=True)
class ModelResources:
    """Ray: the actors that host the clients of one architecture (``backend.model_resources`` entries): their own
    resource shape and count, and a cap on each one's GPU memory."""

    arch: str = ""  # an architecture of the run (model.arch, or an arch of model.per_client)
    num_actors: int = 1
    num_cpus: float = 1.0
    num_gpus: float = 0.0  # a fraction <= 1 or a whole number
    gpu_memory_mb: float = 0.0  # cap per actor (torch's per-process memory fraction); 0: num_gpus x the GPU's memory

    def check(self, path: str) -> None:
        if not isinstance(self.arch, str) or not self.arch:
            raise ConfigError(_p(path, "arch"), "names the architecture these actors host (model.arch or an arch of "
                                                "model.per_client)")
        positive(_p(path, "num_actors"), self.num_actors)
        positive(_p(path, "num_cpus"), self.num_cpus, allow_zero=True)
        positive(_p(path, "num_gpus"), self.num_gpus, allow_zero=True)
        positive(_p(path, "gpu_memory_mb"), self.gpu_memory_mb, allow_zero=True)
        if self.num_gpus > 1 and not float(self.num_gpus).is_integer():
            raise ConfigError(_p(path, "num_gpus"), f"a fraction must be <= 1, or a whole number of GPUs; got "
                                                    f"{self.num_gpus}")
        if self.gpu_memory_mb and not self.num_gpus:
            raise ConfigError(_p(path, "gpu_memory_mb"), "caps GPU memory: set num_gpus too")

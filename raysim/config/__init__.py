"""Typed experiment configuration, validated at the edge.

A YAML file (plus ``--set dotted.key=value`` overrides) becomes a tree of frozen dataclasses. Every problem is
reported as one :class:`ConfigError` naming the dotted field and the allowed values, before any data is loaded or
any Ray process is started.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from raysim.errors import ConfigError
from raysim.config.registry import algorithm_class
from raysim.config.fields import _p, check_path_component, choice, from_dict, positive, to_dict
from raysim.config.yamlio import (MAX_YAML_BYTES, YamlBoundsError, apply_overrides, load_config_dict, load_yaml_mapping,
                           parse_override, read_text_file, set_dotted, yaml_error_text, yaml_load)


MAX_CLIENTS = 10_000_000  # per-client arrays of this length still fit in memory


@dataclass(frozen=True)
class DataConfig:
    dataset: str = "mnist5k"  # a built-in name, a format (npz, imagefolder, leaf), a registered name or an import
    #                          path "package.module:loader" (loader(root, **dataset_params) -> mapping of arrays)
    root: Optional[str] = None  # local directory for file-based datasets (npz: the file)
    dataset_params: dict = field(default_factory=dict)  # keyword arguments of the loader or format (e.g. size)
    num_clients: int = 20
    partition: str = "nway_kshot"
    partition_params: dict = field(default_factory=dict)
    test_fraction: float = 0.2  # per-class share held out as the test pool when a dataset has no test split
    public: Optional[dict] = None  # an explicitly public dataset: {dataset: ..., size: ..., root: ...}
    rotations: Optional[list[float]] = None  # domain shift: client i's images rotated by rotations[i % len] degrees
    val_fraction: float = 0.0  # per-client validation split carved from each client's training data (0: none)
    # MAFML's per-node four-way split {public: a, val: v, test: t} of each client's samples (private = the rest):
    # the test split comes from the client's own samples, the public shares of all clients form the public dataset.
    # mode: dataset (PACS) takes private / val / test part from the dataset's own parts; public: a of the test part
    local_split: Optional[dict] = None
    # a server-held validation set: this many samples of the training pool (class-stratified, seeded), removed from
    # the pool before partitioning, so disjoint from every client's data and from the test set; server steps of a
    # method that declares it read it as ctx.server_data["server_val"] (0: none). The test set reaches only evaluation
    # steps.
    server_val: int = 0

    def check(self, path: str) -> None:
        positive(_p(path, "num_clients"), self.num_clients)
        if self.num_clients > MAX_CLIENTS:
            raise ConfigError(_p(path, "num_clients"), f"{self.num_clients:,} exceeds the {MAX_CLIENTS:,} clients a "
                                                       f"simulation may hold")
        if isinstance(self.server_val, bool) or not isinstance(self.server_val, int) or self.server_val < 0:
            raise ConfigError(_p(path, "server_val"), f"must be a sample count >= 0, got {self.server_val!r}")
        if self.server_val > 0 and self.partition == "files":
            raise ConfigError(_p(path, "server_val"), "is not supported with partition: files (no training pool "
                                                      "outside the clients' split files)")
        if self.server_val > 0 and self.local_split is not None:
            raise ConfigError(_p(path, "server_val"), "is not supported with local_split")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(_p(path, "val_fraction"), f"must be in [0, 1), got {self.val_fraction}")
        if self.rotations is not None and len(self.rotations) == 0:
            raise ConfigError(_p(path, "rotations"), "must list at least one angle (degrees)")
        if not 0.0 < self.test_fraction < 1.0:
            raise ConfigError(_p(path, "test_fraction"), f"must be in (0, 1), got {self.test_fraction}")
        if self.local_split is not None:
            if not isinstance(self.local_split, dict):
                raise ConfigError(_p(path, "local_split"), "must be a mapping {public: a, val: v, test: t}")
            mode = self.local_split.get("mode", "random")
            if mode not in ("random", "dataset"):
                raise ConfigError(_p(path, "local_split.mode"), f"{mode!r} is not allowed; choose one of: random (each "
                                                                f"client's samples split by the fractions), dataset "
                                                                f"(the dataset's own train/validation/test parts)")
            for k, v in self.local_split.items():
                if k == "mode":
                    continue
                if k not in ("public", "val", "test"):
                    raise ConfigError(_p(path, f"local_split.{k}"), "unknown key; allowed: public, val, test, mode")
                if mode == "dataset" and k != "public":
                    raise ConfigError(_p(path, f"local_split.{k}"), "comes from the dataset's own parts with mode: "
                                                                    "dataset (only public is a fraction: of each "
                                                                    "client's test part); remove it")
                if not isinstance(v, (int, float)) or not 0.0 <= float(v) < 1.0:
                    raise ConfigError(_p(path, f"local_split.{k}"), f"must be a fraction in [0, 1), got {v!r}")
            if mode == "dataset" and self.rotations:
                raise ConfigError(_p(path, "rotations"), "local_split mode: dataset takes the dataset's own domains "
                                                         "as they are; remove data.rotations")
            if sum(float(v) for k, v in self.local_split.items() if k != "mode") >= 1.0:
                raise ConfigError(_p(path, "local_split"), "public + val + test must leave a private share (< 1)")
            if self.val_fraction > 0:
                raise ConfigError(_p(path, "val_fraction"), "use local_split.val with local_split (not both)")
            if self.public is not None:
                raise ConfigError(_p(path, "public"), "local_split makes the clients' public shares the public "
                                                      "dataset; remove data.public")
            if self.partition == "files":
                raise ConfigError(_p(path, "local_split"), "is not supported with partition: files")


@dataclass(frozen=True)
class ArchSpec:
    arch: str = "cnn_mnist"  # a zoo name, a registered name or an import path "package.module:factory"
    params: dict = field(default_factory=dict)
    embedding: Optional[str] = None  # user models: the layer (module path or traced node name) whose output is the
    #                                  embedding; the rest of the forward is the head


@dataclass(frozen=True)
class ModelConfig:
    """One architecture for everyone (``arch``/``params``) or per-client ones (``per_client``).

    ``assign``: ``cycle`` (client i gets per_client[i % len]), ``blocks`` (contiguous, near-equal blocks of client
    ids, FedProto's "mh" setting), ``list`` (per_client has one entry per client) or ``tier`` (client i holds
    per_client[tier of i]: the tier comes from ``tiers`` (client i -> tiers[i % len(tiers)]) when given, else from the
    ``env`` section's device memory tier: the largest model such a device can hold)."""

    arch: str = "cnn_mnist"
    params: dict = field(default_factory=dict)
    per_client: Optional[list[ArchSpec]] = None
    assign: str = "cycle"
    tiers: Optional[list[int]] = None  # assign=tier: device tier per client (cycled), an index into per_client
    embedding: Optional[str] = None  # user models: the layer whose output is the embedding (per_client entries
    #                                  without their own take this one)

    def check(self, path: str) -> None:
        choice(_p(path, "assign"), self.assign, ["cycle", "blocks", "list", "tier"])
        specs = [(_p(path, "params"), self.params)] + [(_p(path, f"per_client[{i}].params"), s.params)
                                                       for i, s in enumerate(self.per_client or [])]
        for where, params in specs:
            v = (params or {}).get("embed_dim") if isinstance(params, dict) else None
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"{where}.embed_dim", f"must be an integer >= 1 (the embedding's size), got {v!r}")
        if self.per_client is not None and len(self.per_client) == 0:
            raise ConfigError(_p(path, "per_client"), "must name at least one architecture")
        if self.assign == "tier":
            if self.per_client is None:
                raise ConfigError(_p(path, "per_client"), "assign=tier needs per_client (one architecture per tier)")
            if self.tiers is not None and not self.tiers:
                raise ConfigError(_p(path, "tiers"), "must list at least one tier (or be left out to take the tiers "
                                                     "from the env section's devices)")
            bad = [t for t in (self.tiers or []) if not 0 <= t < len(self.per_client)]
            if bad:
                raise ConfigError(_p(path, "tiers"), f"tier {bad[0]} is not allowed; choose one of: "
                                                     f"{', '.join(map(str, range(len(self.per_client))))}")


@dataclass(frozen=True)
class TrainConfig:
    local_epochs: int = 1
    batch_size: int = 4
    optimizer: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.5
    weight_decay: float = 0.0
    persist_optimizer: bool = False  # keep each client's optimizer state (momentum) across rounds
    local_steps: Optional[int] = None  # exactly this many minibatch steps per round (epochs of shuffled batches
    #                                    continued as needed) instead of local_epochs; None: local_epochs

    def check(self, path: str) -> None:
        positive(_p(path, "local_epochs"), self.local_epochs)
        positive(_p(path, "batch_size"), self.batch_size)
        positive(_p(path, "lr"), self.lr)
        positive(_p(path, "momentum"), self.momentum, allow_zero=True)
        positive(_p(path, "weight_decay"), self.weight_decay, allow_zero=True)
        choice(_p(path, "optimizer"), self.optimizer, ["sgd", "adam"])
        if self.local_steps is not None:
            if isinstance(self.local_steps, bool) or not isinstance(self.local_steps, int):
                raise ConfigError(_p(path, "local_steps"), f"must be a positive integer, got {self.local_steps!r}")
            positive(_p(path, "local_steps"), self.local_steps)


@dataclass(frozen=True)
class AlgorithmConfig:
    name: str = "fedproto"
    params: dict = field(default_factory=dict)


@dataclass(frozen=True)
class EvalConfig:
    every: int = 1  # evaluate every N rounds (the last round is always evaluated)
    fraction: float = 1.0  # share of the clients evaluated per evaluation round (a seeded sample; huge populations)

    def check(self, path: str) -> None:
        positive(_p(path, "every"), self.every)
        if not 0.0 < self.fraction <= 1.0:
            raise ConfigError(_p(path, "fraction"), f"must be in (0, 1], got {self.fraction}")


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
    #   true | false | auto (the default: on where the clients train on a GPU, the per-client loop on a CPU); on, it
    #   changes the numbers within a stated tolerance, so it is part of the run's identity (vectorizes())
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


@dataclass(frozen=True)
class OutputConfig:
    dir: str = "runs"
    checkpoint_every: int = 0  # 0: only at the end
    keep_checkpoints: int = 2  # the newest N round checkpoints stay (older ones are removed); 0: every one stays
    progress: Any = True  # true (auto): a tqdm bar when stderr is a terminal, else one line per evaluated round (a
    #                       log file gets no \r frames) | bar | lines | false (none)
    tensorboard: Optional[str] = None  # a directory: TensorBoard event files per run (raysim/engine/tracking.py)
    mlflow: Optional[str] = None  # an MLflow tracking URI (file:///path/mlruns, http://host:5000): one MLflow run each
    wandb: Optional[str] = None  # a directory: Weights & Biases offline runs (DIR/wandb/offline-run-*; wandb sync)

    def check(self, path: str) -> None:
        positive(_p(path, "checkpoint_every"), self.checkpoint_every, allow_zero=True)
        positive(_p(path, "keep_checkpoints"), self.keep_checkpoints, allow_zero=True)
        if not (isinstance(self.progress, bool) or self.progress in ("auto", "bar", "lines")):
            raise ConfigError(_p(path, "progress"), f"{self.progress!r} is not allowed; choose one of: auto, bar, "
                                                    f"lines, true, false")
        for key in ("tensorboard", "mlflow", "wandb"):
            v = getattr(self, key)
            if v is not None and (not isinstance(v, str) or not v.strip()):
                raise ConfigError(_p(path, key), f"must be a {'tracking URI' if key == 'mlflow' else 'directory'}"
                                                 f" (text), got {v!r}")


@dataclass(frozen=True)
class StalenessConfig:
    """s(tau), the weight of an update that is tau server versions old (Xie et al. 2019): constant (1), polynomial
    ((1 + tau)^-a) or hinge (1 up to b versions, then 1 / (a (tau - b) + 1))."""

    fn: str = "constant"
    a: float = 0.5
    b: int = 4

    def check(self, path: str) -> None:
        choice(_p(path, "fn"), self.fn, ["constant", "polynomial", "hinge"])
        if self.a < 0:
            raise ConfigError(_p(path, "a"), f"the staleness exponent must be >= 0, got {self.a}")
        positive(_p(path, "b"), self.b, allow_zero=True)


@dataclass(frozen=True)
class ServerConfig:
    """``mode: sync`` (rounds: the default) or ``async``: an event-driven server on the environment's simulated
    clock (raysim/engine/async_loop.py). ``concurrency`` clients train at once; each is dispatched with the current
    server state and its update arrives when the environment says; ``rule: fedbuff`` aggregates every
    ``buffer_size`` arrivals, each a delta against the version its client was dispatched with, and applies their
    weighted mean scaled by ``server_lr``, ``rule: fedasync`` applies each arrival
    with weight ``alpha * s(tau)``. Each applied aggregation is a server version; ``rounds`` counts versions.
    ``max_staleness``: updates older than this many versions are discarded (wasted work; None: none)."""

    mode: str = "sync"
    rule: str = "fedbuff"
    concurrency: int = 10
    buffer_size: int = 5
    server_lr: float = 1.0
    alpha: float = 0.6
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    max_staleness: Optional[int] = None

    def check(self, path: str) -> None:
        choice(_p(path, "mode"), self.mode, ["sync", "async"])
        choice(_p(path, "rule"), self.rule, ["fedbuff", "fedasync"])
        positive(_p(path, "concurrency"), self.concurrency)
        positive(_p(path, "buffer_size"), self.buffer_size)
        positive(_p(path, "server_lr"), self.server_lr)
        if not 0.0 < self.alpha <= 1.0:
            raise ConfigError(_p(path, "alpha"), f"must be in (0, 1], got {self.alpha}")
        positive(_p(path, "max_staleness"), self.max_staleness, allow_zero=True)
        if self.mode == "async" and self.rule == "fedbuff" and self.buffer_size > self.concurrency:
            raise ConfigError(_p(path, "buffer_size"), f"{self.buffer_size} exceeds server.concurrency="
                                                       f"{self.concurrency} (the buffer could never fill)")


@dataclass(frozen=True)
class ExperimentConfig:
    name: str = "experiment"
    label: Optional[str] = None  # how reports name this run's setting (raysim report; --label NAME=DIR wins)
    seed: int = 1234
    rounds: int = 100
    clients_per_round: Optional[int] = None  # None: every client every round
    on_client_failure: str = "skip"  # skip: aggregate the survivors; stop: stop the run at the first failure
    on_nonfinite: str = "stop"  # a NaN/inf loss, metric or upload: stop the run (exit 1) | skip_client: drop that update
    on_actor_failure: str = "retry"  # a client actor died: retry (recreate it, rerun its clients) | skip | stop
    max_retries: int = 3  # retries of one actor's step; one more death stops the run (exit 1)
    # on_client_failure: skip stops the run (exit 1, checkpoints kept) when more than this share of a step's clients
    # failed in one round (1.0: only when all failed); skipped failures are counted in the table and the metadata
    max_failed_share: float = 0.5
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    env: Optional[dict] = None  # simulated environment (envs/, validated there); None: no simulation
    server: ServerConfig = field(default_factory=ServerConfig)  # sync rounds, or async on the simulated clock

    def check(self, path: str) -> None:
        check_path_component("name", self.name)
        positive("rounds", self.rounds)
        positive("clients_per_round", self.clients_per_round)
        choice("on_client_failure", self.on_client_failure, ["skip", "stop"])
        choice("on_nonfinite", self.on_nonfinite, ["stop", "skip_client"])
        choice("on_actor_failure", self.on_actor_failure, ["retry", "skip", "stop"])
        positive("max_retries", self.max_retries, allow_zero=True)
        if isinstance(self.max_failed_share, bool) or not 0.0 <= self.max_failed_share <= 1.0:
            raise ConfigError("max_failed_share", f"must be a share in [0, 1] of a round's clients that may fail "
                                                  f"before the run stops, got {self.max_failed_share!r}")
        archs = [self.model.arch] if self.model.per_client is None else [a.arch for a in self.model.per_client]
        for i, r in enumerate(self.backend.model_resources or []):
            if r.arch not in archs:
                raise ConfigError(f"backend.model_resources[{i}].arch", f"{r.arch!r} is not an architecture of this "
                                                                        f"run; choose one of: {', '.join(dict.fromkeys(archs))}")
        if self.clients_per_round is not None and self.clients_per_round > self.data.num_clients:
            raise ConfigError("clients_per_round", f"{self.clients_per_round} exceeds data.num_clients={self.data.num_clients}")
        if self.server.mode == "async":
            self._check_async()
        if self.model.assign == "tier" and getattr(self.model, "tiers", None) is None and (
                self.env is None or self.model.per_client is None):
            raise ConfigError("model.tiers", "assign=tier gives client i per_client[tier of i]; it needs model.per_client "
                                             "and either model.tiers (a tier per client) or an env section whose devices "
                                             "have memory tiers (e.g. env: {preset: mobile-heterogeneous})")

    def _check_async(self) -> None:
        s = self.server
        if s.concurrency > self.data.num_clients:
            raise ConfigError("server.concurrency", f"{s.concurrency} exceeds data.num_clients={self.data.num_clients}")
        if self.env is None:
            raise ConfigError("server.mode", "async runs on the environment's simulated clock; add an env section "
                                             "(e.g. env: {preset: mobile-heterogeneous})")
        if self.clients_per_round is not None:
            raise ConfigError("clients_per_round", "is a round setting; with server.mode: async the clients in flight "
                                                   "are server.concurrency (remove clients_per_round)")

    # -- identity -----------------------------------------------------------------------------------------------
    def science_dict(self) -> dict:
        """The part of the config that determines the numbers (not where or how fast they are computed)."""
        d = to_dict(self)
        for spec in d["model"].get("per_client") or []:  # a key added later: absent unless set (identity unchanged)
            if spec.get("embedding") is None:
                spec.pop("embedding", None)
        # the executor and the kernel choice change the numbers (the executor within tolerance, kernels in last bits)
        inert = self.inert_backend()  # switches that do nothing for this method and run: not part of what it is
        d["backend"] = {"vectorize": self.vectorizes() and "vectorize" not in inert,
                        "numerics": self.backend.numerics}
        if self.backend.max_group and d["backend"]["vectorize"]:  # a key added later: absent unless set
            d["backend"]["max_group"] = self.backend.max_group
        if self.backend.partial_aggregate is True and "partial_aggregate" not in inert:  # a key added later: absent
            d["backend"]["partial_aggregate"] = True  # unless on (earlier identities unchanged)
        d.pop("output")
        d.pop("name")
        d.pop("label")  # a display name
        d.pop("on_actor_failure")  # recovery policies: a retried client reproduces exactly
        d.pop("max_retries")
        d.pop("max_failed_share")  # when to stop, not what a finished run computes
        return d

    def vectorizes(self) -> bool:
        """``backend.vectorize`` resolved for this run (:meth:`BackendConfig.vectorizes`); auto stays off with
        ``train.local_steps`` (the batched executor runs whole epochs: the loop runs them)."""
        auto_off = self.backend.vectorize == "auto" and self.train.local_steps is not None
        return self.backend.vectorizes() and not auto_off

    def inert_backend(self) -> tuple[str, ...]:
        """The ``backend`` switches set on (``vectorize``, ``partial_aggregate: true``) that cannot change this run's
        numbers (the method's ``settings_without_effect``: raysim.algorithm): left out of the identity, and said
        (``prepare``). Empty when the method cannot be resolved (its error comes from prepare)."""
        on = (["vectorize"] if self.vectorizes() else []) + (
            ["partial_aggregate"] if self.backend.partial_aggregate is True else [])
        if not on:
            return ()
        try:
            inert = algorithm_class(self.algorithm.name).settings_without_effect(self.env is not None)
        except Exception:
            return ()
        return tuple(k for k in on if k in inert)

    def identity_dict(self, drop: tuple = ()) -> dict:
        """The science keys whose values differ from their defaults, as {dotted key: value}. Algorithm parameters
        are compared with the method's own defaults. Adding a key with a behaviour-preserving default therefore
        never changes an old config's identity, while every key that changes the numbers does."""
        # the baseline is the per-client loop wherever it runs (vectorize: auto resolves by the device: a GPU run that
        # batches is named as one that asked for it, a CPU run as before auto existed)
        default = ExperimentConfig(backend=BackendConfig(vectorize=False)).science_dict()
        mine = self.science_dict()
        out = _diff_leaves(mine, default, "")
        out.pop("algorithm.params", None)
        out.update({f"algorithm.params.{k}": v for k, v in _algorithm_param_diff(self.algorithm).items()})
        for key in drop:
            out.pop(key, None)
        return dict(sorted(out.items()))

    def config_hash(self, drop: tuple = ()) -> str:
        blob = json.dumps({"v": 2, "set": self.identity_dict(drop)}, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:10]

    def run_id(self) -> str:
        return f"{self.name}-s{self.seed}-{self.config_hash()}"


def _diff_leaves(mine, default, prefix: str) -> dict:
    """Dotted keys of ``mine`` whose values differ from ``default``; sections recurse, mapping-valued fields whose
    default is empty (partition_params, env, ...) are compared whole."""
    out = {}
    if isinstance(mine, dict) and isinstance(default, dict) and default:
        for k in sorted(set(mine) | set(default)):
            key = f"{prefix}.{k}" if prefix else str(k)
            if k not in mine:
                continue
            if k not in default:
                out[key] = mine[k]
            else:
                out.update(_diff_leaves(mine[k], default[k], key))
        return out
    if mine != default:
        out[prefix] = mine
    return out


def _algorithm_param_diff(alg: "AlgorithmConfig") -> dict:
    """The algorithm's parameters that differ from the method's defaults (raw values when the method is unknown)."""
    params = dict(alg.params or {})
    try:
        cls = algorithm_class(alg.name)
        defaults = json.loads(json.dumps(dataclasses.asdict(cls.Params()), default=str))
        typed = json.loads(json.dumps(dataclasses.asdict(from_dict(cls.Params, params, "algorithm.params")), default=str))
    except Exception:
        return params
    return {k: v for k, v in typed.items() if defaults.get(k, object()) != v}


OLD_VALUES = {("on_client_failure", "raise"): "stop"}  # (key, a value's old name) -> its name now, still accepted


def make_config(data: dict | None = None, overrides: list[str] | None = None, notify=None) -> ExperimentConfig:
    d = apply_overrides(data or {}, overrides, notify)
    for (key, old), new in OLD_VALUES.items():
        if isinstance(d, dict) and d.get(key) == old:
            d = {**d, key: new}
    return from_dict(ExperimentConfig, d)


def load_config(path: str | Path, overrides: list[str] | None = None, notify=None) -> ExperimentConfig:
    """The config in the YAML file ``path`` with ``overrides``; ``notify(message)`` receives the notices (a switched
    method's parameters; default: one line each on stderr)."""
    return make_config(load_config_dict(path), overrides, notify)


# the public names of the configuration layer (the sections here; dict <-> dataclass in raysim.config.fields; YAML and
# overrides in raysim.config.yamlio): importable from raysim.config as before
__all__ = ["AlgorithmConfig", "ArchSpec", "BackendConfig", "ConfigError", "DataConfig", "EvalConfig", "ExperimentConfig",
           "ServerConfig", "StalenessConfig",
           "MAX_YAML_BYTES", "ModelConfig", "OutputConfig", "TrainConfig", "YamlBoundsError", "apply_overrides",
           "check_path_component", "choice", "from_dict", "load_config", "load_config_dict", "load_yaml_mapping",
           "make_config", "parse_override", "positive", "read_text_file", "set_dotted", "to_dict", "yaml_error_text",
           "yaml_load"]

"""Typed experiment configuration, validated at the edge.

A YAML file (plus ``--set dotted.key=value`` overrides) becomes a tree of frozen dataclasses. Every problem is
reported as one :class:`ConfigError` naming the dotted field and the allowed values, before any data is loaded or
any Ray process is started.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import json
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from raysim.errors import ConfigError


# ----------------------------------------------------------------------------------------------------------------
# generic dataclass <- dict conversion with type checking


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _coerce(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, path)
            except ConfigError as e:
                errors.append(str(e))
        allowed = " or ".join(_type_name(a) for a in args)
        raise ConfigError(path, f"expected {allowed}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping of {tp.__name__} fields, got {value!r}")
        return from_dict(tp, value, path)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"expected a list, got {value!r}")
        inner = args[0] if args else Any
        out = [_coerce(v, inner, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(path, f"expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(path, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and _FLOAT_RE.match(value.strip()):
            return float(value)  # e.g. a quoted "1e-3"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {value!r}")
        return value
    return value


def from_dict(cls, data: dict, path: str = ""):
    """Build dataclass ``cls`` from ``data``; unknown keys and wrong types raise :class:`ConfigError`."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(path or cls.__name__, f"expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            where = f"{path}.{key}" if path else str(key)
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(where, f"unknown key{hint}; allowed keys: {', '.join(sorted(fields))}")
    kwargs = {}
    for name, f in fields.items():
        where = f"{path}.{name}" if path else name
        if name in data:
            kwargs[name] = _coerce(data[name], hints[name], where)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(where, "is required")
    obj = cls(**kwargs)
    check = getattr(obj, "check", None)
    if check is not None:
        check(path)
    return obj


def to_dict(obj) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(obj), default=str))


def choice(path: str, value: Any, allowed) -> None:
    allowed = list(allowed)
    if value not in allowed:
        raise ConfigError(path, f"{value!r} is not allowed; choose one of: {', '.join(map(str, allowed))}")


def positive(path: str, value, allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(path, f"must be {'>= 0' if allow_zero else '> 0'}, got {value}")


# a config value that becomes part of a file or directory name (the run name, a study name): letters, digits and
# . _ + - : = only, starting with a letter or digit (no separators, no hidden names, no '..'), at most 100 characters
_SAFE_COMPONENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+:=-]{0,99}$")


def check_path_component(field_path: str, value) -> str:
    """``value`` may become part of a path: refuse separators, ``..``, hidden names, control characters and anything
    outside a portable character set (ConfigError naming ``field_path``)."""
    if not isinstance(value, str) or not _SAFE_COMPONENT.match(value) or ".." in value:
        raise ConfigError(field_path, f"{value!r} is not a safe name: it becomes part of a directory name, so use "
                                      f"1-100 letters, digits and . _ + - : = (starting with a letter or digit; no path "
                                      f"separators, no '..')")
    return value


def _p(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


# ----------------------------------------------------------------------------------------------------------------
# the experiment configuration


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
    vectorize: bool = False  # train the clients of one architecture in a step together (torch.func vmap); changes
    #                          the numbers within a stated tolerance, so it is part of the run's identity
    code: Any = "auto"  # Ray: the user code shipped to every actor: auto (the modules the config's import paths and
    #                     registrations load from outside installed packages, with their sibling modules), none,
    #                     working_dir (the whole working directory as Ray's working_dir), or a list of module files /
    #                     package directories (Ray py_modules)

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
        positive(_p(path, "connect_timeout_s"), self.connect_timeout_s)
        if self.address is not None and not str(self.address).strip():
            raise ConfigError(_p(path, "address"), "is empty; give host:port of a running Ray head (or leave it out "
                                                   "to start a local cluster)")
        choice(_p(path, "device"), self.device, ["auto", "cpu", "cuda"])
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


@dataclass(frozen=True)
class OutputConfig:
    dir: str = "runs"
    checkpoint_every: int = 0  # 0: only at the end
    progress: bool = True

    def check(self, path: str) -> None:
        positive(_p(path, "checkpoint_every"), self.checkpoint_every, allow_zero=True)


@dataclass(frozen=True)
class ExperimentConfig:
    name: str = "experiment"
    seed: int = 1234
    rounds: int = 100
    clients_per_round: Optional[int] = None  # None: every client every round
    on_client_failure: str = "skip"  # skip: aggregate the survivors; stop: stop the run at the first failure
    on_nonfinite: str = "stop"  # a NaN/inf loss, metric or upload: stop the run (exit 1) | skip_client: drop that update
    on_actor_failure: str = "retry"  # a client actor died: retry (recreate it, rerun its clients) | skip | stop
    max_retries: int = 3  # retries of one actor's step before on_actor_failure falls back to skip
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    env: Optional[dict] = None  # simulated environment (envs/, validated there); None: no simulation

    def check(self, path: str) -> None:
        check_path_component("name", self.name)
        positive("rounds", self.rounds)
        positive("clients_per_round", self.clients_per_round)
        choice("on_client_failure", self.on_client_failure, ["skip", "stop"])
        choice("on_nonfinite", self.on_nonfinite, ["stop", "skip_client"])
        choice("on_actor_failure", self.on_actor_failure, ["retry", "skip", "stop"])
        positive("max_retries", self.max_retries, allow_zero=True)
        if self.clients_per_round is not None and self.clients_per_round > self.data.num_clients:
            raise ConfigError("clients_per_round", f"{self.clients_per_round} exceeds data.num_clients={self.data.num_clients}")
        if self.model.assign == "tier" and getattr(self.model, "tiers", None) is None and (
                self.env is None or self.model.per_client is None):
            raise ConfigError("model.tiers", "assign=tier gives client i per_client[tier of i]; it needs model.per_client "
                                             "and either model.tiers (a tier per client) or an env section whose devices "
                                             "have memory tiers (e.g. env: {preset: mobile-heterogeneous})")

    # -- identity -----------------------------------------------------------------------------------------------
    def science_dict(self) -> dict:
        """The part of the config that determines the numbers (not where or how fast they are computed)."""
        d = to_dict(self)
        for spec in d["model"].get("per_client") or []:  # a key added later: absent unless set (identity unchanged)
            if spec.get("embedding") is None:
                spec.pop("embedding", None)
        d["backend"] = {"vectorize": self.backend.vectorize}  # the executor changes the numbers (within tolerance)
        d.pop("output")
        d.pop("name")
        d.pop("on_actor_failure")  # recovery policies: a retried client reproduces exactly
        d.pop("max_retries")
        return d

    def identity_dict(self, drop: tuple = ()) -> dict:
        """The science keys whose values differ from their defaults, as {dotted key: value}. Algorithm parameters
        are compared with the method's own defaults. Adding a key with a behaviour-preserving default therefore
        never changes an old config's identity, while every key that changes the numbers does."""
        default = ExperimentConfig().science_dict()
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
        from raysim.registry import algorithm_class

        cls = algorithm_class(alg.name)
        defaults = json.loads(json.dumps(dataclasses.asdict(cls.Params()), default=str))
        typed = json.loads(json.dumps(dataclasses.asdict(from_dict(cls.Params, params, "algorithm.params")), default=str))
    except Exception:
        return params
    return {k: v for k, v in typed.items() if defaults.get(k, object()) != v}


# ----------------------------------------------------------------------------------------------------------------
# loading


# PyYAML follows YAML 1.1, whose float pattern needs a dot and a signed exponent: ``1e-3`` and ``1E6`` load as
# strings. This loader adds YAML 1.2's float syntax, so every float field accepts them (files and --set alike).
_FLOAT_RE = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)(?:[eE][-+]?[0-9]+)?$"
                       r"|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$")
_YAML12_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")


class YamlLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that also reads ``1e-3``, ``5E-4``, ``1e6`` as floats (YAML 1.2)."""


YamlLoader.add_implicit_resolver("tag:yaml.org,2002:float", _YAML12_FLOAT, list("-+0123456789."))


MAX_YAML_BYTES = 1 << 20  # config and search-space files (a config is a few KB)
MAX_YAML_VALUES = 100_000  # values in the document once aliases are expanded (a 'billion laughs' stays far below)
MAX_YAML_DEPTH = 32  # nesting of mappings and lists


class YamlBoundsError(yaml.YAMLError):
    """A YAML document that is too large once expanded, or nested too deeply."""


def _check_bounds(data, source: str) -> None:
    """Walk the loaded document as the tree it stands for (aliases expanded), giving up after MAX_YAML_VALUES values
    or below MAX_YAML_DEPTH levels: a document of nested aliases is refused in O(limit) time and memory, before
    anything copies or serialises it."""
    count = 0
    stack = [(data, 0)]
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > MAX_YAML_VALUES:
            raise YamlBoundsError(f"{source}: expands to more than {MAX_YAML_VALUES:,} values (nested YAML aliases, "
                                  f"a 'billion laughs' document?); raysim refuses it — write the values out")
        if isinstance(node, dict):
            children = list(node.keys()) + list(node.values())
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            continue
        if depth >= MAX_YAML_DEPTH:
            raise YamlBoundsError(f"{source}: nested more than {MAX_YAML_DEPTH} levels deep; raysim refuses it")
        stack.extend((c, depth + 1) for c in children)


def yaml_load(text: str, source: str = "<string>"):
    """Parse YAML text with :class:`YamlLoader`; ``source`` names the file in error messages. The document is
    bounded: at most MAX_YAML_BYTES of text, MAX_YAML_VALUES values with aliases expanded, MAX_YAML_DEPTH levels."""
    import io

    if len(text) > MAX_YAML_BYTES:
        raise YamlBoundsError(f"{source}: {len(text):,} characters, more than the {MAX_YAML_BYTES:,} a config may hold")
    stream = io.StringIO(text)
    stream.name = source  # PyYAML's marks name the stream's ``name``
    depth = 0  # the parser is iterative (the composer recurses): refuse deep nesting before composing
    for event in yaml.parse(stream, Loader=YamlLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_YAML_DEPTH:
                raise YamlBoundsError(f"{source}: nested more than {MAX_YAML_DEPTH} levels deep; raysim refuses it")
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
    stream = io.StringIO(text)
    stream.name = source
    try:
        data = yaml.load(stream, Loader=YamlLoader)
    except RecursionError:
        raise YamlBoundsError(f"{source}: nested too deeply to parse; raysim refuses it") from None
    _check_bounds(data, source)
    return data


def yaml_error_text(e: yaml.YAMLError, source: str) -> str:
    """A YAML error in one line: where (file, line, column) and what."""
    if isinstance(e, YamlBoundsError):
        return str(e)
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = f"{source}, line {mark.line + 1}, column {mark.column + 1}" if mark is not None else source
    what = " ".join(str(x) for x in (getattr(e, "context", None), getattr(e, "problem", None)) if x) or str(e)
    return f"{where}: {what}".replace("\n", " ")


def parse_override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise ConfigError(text, "an override must look like dotted.key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(text, "an override needs a key before '='")
    try:
        value = yaml_load(raw, "--set") if raw.strip() else ""
    except YamlBoundsError as e:
        raise ConfigError(key, str(e)) from None
    except yaml.YAMLError:
        value = raw
    return key, value


def set_dotted(data: dict, key: str, value) -> dict:
    """A copy of the config dict ``data`` with ``key`` (dotted) set to ``value``; sections are created as needed."""
    data = copy.deepcopy(data or {})
    node = data
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(".".join(parts[: i + 1]), f"is a value, not a section; cannot set {key}")
        node = nxt
    node[parts[-1]] = value
    return data


def apply_overrides(data: dict, overrides: list[str] | None, notify=None) -> dict:
    """``data`` with every ``dotted.key=value`` override applied. When an override changes ``algorithm.name``, the
    ``algorithm.params`` that the new method does not have are dropped and ``notify`` (default: one line on stderr)
    says which: the file's parameters were written for the file's method."""
    data = json.loads(json.dumps(data or {}))
    before = (data.get("algorithm") or {}).get("name") if isinstance(data.get("algorithm"), dict) else None
    for text in overrides or []:
        data = set_dotted(data, *parse_override(text))
    algo = data.get("algorithm")
    if isinstance(algo, dict) and algo.get("name") != before and isinstance(algo.get("params"), dict):
        explicit = {k.split(".", 2)[2] for k, _ in map(parse_override, overrides or [])
                    if k.startswith("algorithm.params.") and k.count(".") >= 2}
        algo["params"] = _drop_foreign_params(before, algo.get("name"), algo["params"], explicit, notify)
    return data


def _drop_foreign_params(old: str, new: str, params: dict, explicit: set, notify) -> dict:
    try:
        from raysim.registry import algorithm_class

        allowed = {f.name for f in dataclasses.fields(algorithm_class(new).Params)}
    except Exception:  # an unknown name is reported, naming algorithm.name, when the config is built
        return params
    dropped = [k for k in params if k not in allowed and k not in explicit]
    if dropped:
        kept = [k for k in params if k not in dropped]
        (notify or _stderr_notice)(
            f"algorithm.name changed from {old} to {new}: dropped algorithm.params {', '.join(dropped)} "
            f"({new} has no such parameters){'; kept ' + ', '.join(kept) if kept else ''}")
    return {k: v for k, v in params.items() if k not in dropped}


def _stderr_notice(message: str) -> None:
    print(f"raysim: note: {message}", file=sys.stderr)


def read_text_file(path: str | Path, field_name: str, max_bytes: int = MAX_YAML_BYTES, what: str = "file") -> str:
    """The text of a small file the user named (config, search space): one ConfigError naming ``field_name`` and the
    file when it is missing, a directory or not a regular file, unreadable, too large, or not UTF-8 text."""
    import os
    import stat

    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(field_name, f"file not found: {path}") from None
    except OSError as e:
        raise ConfigError(field_name, f"cannot read {path}: {e.strerror or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise ConfigError(field_name, f"{path} is a directory; give the {what} inside it")
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(field_name, f"{path} is not a regular file; give a YAML {what}")
    if st.st_size > max_bytes:
        raise ConfigError(field_name, f"{path} is {st.st_size:,} bytes, more than the {max_bytes:,} a {what} may "
                                      f"hold; is it the right file?")
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise ConfigError(field_name, f"cannot read {path}: {e.strerror or e}; check its permissions") from None
    if b"\0" in raw:
        raise ConfigError(field_name, f"{path} is a binary file, not a YAML {what} (damaged or the wrong file)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(field_name, f"{path} is not UTF-8 text (byte {e.start}); damaged or the wrong file") from None


def load_yaml_mapping(path: str | Path, field_name: str = "CONFIG", what: str = "config") -> dict:
    """A YAML file holding a mapping; errors name ``field_name`` (the argument that gave the path) and the file."""
    path = Path(path)
    text = read_text_file(path, field_name, what=what)
    try:
        data = yaml_load(text, str(path))
    except YamlBoundsError as e:
        raise ConfigError(field_name, str(e)) from None
    except yaml.YAMLError as e:
        raise ConfigError(field_name, f"not valid YAML: {yaml_error_text(e, str(path))}") from None
    if data is None:
        raise ConfigError(field_name, f"{path} is empty (no settings); write the {what} into it"
                                      + (" (a config of defaults: name: experiment)" if what == "config" else ""))
    if not isinstance(data, dict):
        raise ConfigError(field_name, f"{path} must hold a mapping at the top level, got {type(data).__name__} "
                                      f"(damaged or the wrong file?)")
    return data


def load_config_dict(path: str | Path) -> dict:
    return load_yaml_mapping(path, "CONFIG")


OLD_VALUES = {("on_client_failure", "raise"): "stop"}  # (key, a value's old name) -> its name now, still accepted


def make_config(data: dict | None = None, overrides: list[str] | None = None, notify=None) -> ExperimentConfig:
    d = apply_overrides(data or {}, overrides, notify)
    for (key, old), new in OLD_VALUES.items():
        if isinstance(d, dict) and d.get(key) == old:
            d = {**d, key: new}
    return from_dict(ExperimentConfig, d)


def load_config(path: str | Path, overrides: list[str] | None = None) -> ExperimentConfig:
    return make_config(load_config_dict(path), overrides)

"""The whole config (:class:`ExperimentConfig`: the top-level keys and every section, their joint checks) and its
identity (``science_dict``, ``identity_dict``, ``config_hash``, ``run_id``); :func:`make_config` and
:func:`load_config`."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from raysim.errors import ConfigError
from raysim.config.registry import algorithm_class
from raysim.config.fields import check_path_component, choice, from_dict, positive, to_dict
from raysim.config.yamlio import apply_overrides, load_config_dict
from raysim.config.backend import BackendConfig
from raysim.config.data import DataConfig
from raysim.config.learning import AlgorithmConfig, EvalConfig, TrainConfig
from raysim.config.model import ModelConfig
from raysim.config.output import OutputConfig
from raysim.config.server import ServerConfig


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
        ``train.local_steps`` for a LocalTraining method (the batched executor runs whole epochs: the loop runs them;
        other methods' group forms do not read it), and is on on a CPU too for a method whose group forms are its CPU
        default (``Algorithm.vectorize_on_cpu``: MAFML)."""
        if self.backend.vectorize == "auto":
            cls = self._method()
            if self.train.local_steps is not None and (cls is None or _is_local_training(cls)):
                return False  # whole epochs only, on every device (the same identity on a CPU and a GPU)
            if getattr(cls, "vectorize_on_cpu", False) and not self.backend.clients_on_gpu():
                return True
        return self.backend.vectorizes()

    def _method(self):
        """The method's class, or None for an unknown name (its error comes from prepare; a method that fails to
        import fails here)."""
        try:
            return algorithm_class(self.algorithm.name)
        except ConfigError:
            return None

    def _vectorize_on_cpu(self) -> bool:
        return bool(getattr(self._method(), "vectorize_on_cpu", False))

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
        # batches is named as one that asked for it, a CPU run as before auto existed -- except a method whose group
        # forms are its CPU default, Algorithm.vectorize_on_cpu: MAFML's CPU runs are named as ones that asked too)
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


def _is_local_training(cls) -> bool:
    """``cls`` is a raysim.algorithm.LocalTraining method (checked by name along its MRO: the config sits below the
    contract and does not import it)."""
    return any(f"{k.__module__}.{k.__qualname__}" == "raysim.algorithm.LocalTraining" for k in cls.__mro__)


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

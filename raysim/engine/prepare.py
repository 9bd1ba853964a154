"""Validation and preparation, once, on the driver, before anything runs: algorithm and model parameters, the
population's memory, the data (loading and partitioning), the algorithm against the task, the resources the backend
needs. The typed Params travel to the runners in the :class:`~raysim.runner.runners.RunSpec`, which never parse or
validate again."""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from typing import Any, Callable, Optional


from raysim.io import rundir
from raysim.algorithm import SERVER_DATA, LocalTraining, Task
from raysim.engine.backend import preflight
from raysim import numerics
from raysim.config import ExperimentConfig, from_dict
from raysim.data.federated import FederatedData, build_federated_data
from raysim.errors import ConfigError
from raysim.models import client_archs
from raysim.config.registry import algorithm_class, algorithm_target, make_environment
from raysim.engine.environment import check_environment
from raysim.engine.settings import BackendSettings, backend_settings, runner_settings
from raysim.runner.runners import RunSpec
from raysim.steps import check_schedule


@dataclass
class Prepared:
    cfg: ExperimentConfig
    fed_data: FederatedData
    task: Task
    spec: RunSpec
    backend: BackendSettings  # what the backend reads (raysim.engine.settings)
    env: Any = None  # envs.Environment when the config has an env section
    algorithm: Any = None  # a driver-side instance (schedules only; never trained)
    models: dict = field(default_factory=dict)  # arch key -> {"params": count, "embed_dim": size or None}


def prepare(cfg: ExperimentConfig) -> Prepared:
    """Everything that can be checked before a run starts, cheapest first: algorithm and model parameters, then the
    data (loading and partitioning), then the algorithm against the task, then the resources the backend needs.
    The typed Params travel to the runners, which never parse or validate again."""
    algo_cls = algorithm_class(cfg.algorithm.name)
    params = from_dict(algo_cls.Params, dict(cfg.algorithm.params or {}), "algorithm.params")
    _check_model_params(cfg)
    _check_server_data(cfg, algo_cls)
    if cfg.server.mode == "async":
        from raysim.asyncrules import check_async_method

        check_async_method(cfg, algo_cls)
    _notice_dropped(cfg)
    _check_population_memory(cfg)
    _check_state_dir(cfg)
    backend = backend_settings(cfg)
    preflight(backend)  # actor counts, CPUs, GPUs and memory: before any data is built
    fed = build_federated_data(cfg.data, cfg.seed)
    env = make_environment(cfg, fed)  # None without an env section
    check_environment(env)
    env_tiers = env is not None and cfg.model.assign == "tier" and getattr(cfg.model, "tiers", None) is None
    archs = tuple(env.archs(cfg.model) if env_tiers else client_archs(cfg.model, cfg.data.num_clients))
    task = Task(fed.num_classes, tuple(fed.input_shape), cfg.data.num_clients, archs, cfg.train, cfg.seed, cfg.rounds,
                fed.public, cfg.data.val_fraction)
    models = _build_models_once(cfg, algo_cls, task)
    algorithm = _make_algorithm(cfg, algo_cls, params, task)
    if cfg.server.mode == "async":
        from raysim.asyncrules import check_async

        check_async(cfg, algorithm, env)
    if cfg.backend.numerics == "portable" and cfg.vectorizes() and not cfg.backend.clients_on_gpu():  # (or auto)
        _check_fixed_gemm(cfg)
    if cfg.backend.name == "ray" and cfg.backend.model_resources:
        from raysim.runner.footprint import check_gpu_budgets

        check_gpu_budgets(cfg, task)
    if env is not None:
        env.bind(task)
    from raysim.config import registry, usercode

    code = usercode.code_to_ship(cfg) if cfg.backend.name == "ray" else ()
    if code:  # what leaves for the actors, said (files, bytes)
        _notice_once("note: " + usercode.describe_shipped(list(code)))
    spec = RunSpec(runner_settings(cfg), cfg.data, task, algorithm_target(cfg.algorithm.name), params,
                   registry=registry.snapshot(),
                   code=tuple(code), cwd=None if cfg.backend.code == "working_dir" else os.getcwd(),
                   server_data=_instance_server_data(algorithm, algo_cls))
    return Prepared(cfg, fed, task, spec, backend, env, algorithm, models)


def _check_model_params(cfg: ExperimentConfig) -> None:
    """Every architecture's name resolves and its params are ones it takes (before any data is loaded)."""
    from raysim.adapt import resolve_factory
    from raysim.models import ARCHS, arch_params

    specs = [("model", cfg.model)] if cfg.model.per_client is None else [
        (f"model.per_client[{i}]", s) for i, s in enumerate(cfg.model.per_client)]
    for path, spec in specs:
        if spec.arch not in ARCHS:
            resolve_factory(spec.arch, f"{path}.arch", ARCHS)  # a user model: its import path resolves (built below)
            continue
        for k in spec.params:
            if k not in arch_params(spec.arch):
                raise ConfigError(f"{path}.params.{k}", f"unknown parameter for {spec.arch}; allowed: "
                                                         f"{', '.join(arch_params(spec.arch))}")


def _build_models_once(cfg: ExperimentConfig, algo_cls, task: Task) -> dict:
    """Build each architecture once: bad values fail here, naming the field; a user model without an embedding for
    a method that needs one, and models the vectorised executor refuses, too. Returns arch key -> its description."""
    from raysim.adapt import WholeModel, describe, suggest_embedding
    from raysim.models import arch_key, build_model

    models = {}  # arch key -> {"params": count, "embed_dim": size or None}
    for i, spec in enumerate(task.archs):
        if arch_key(spec) in models:
            continue
        path = "model" if cfg.model.per_client is None else _per_client_path(cfg.model, spec, i)
        _check_model_size(spec, task, path)
        try:
            built = build_model(spec, task.input_shape, task.num_classes, path)
        except (TypeError, ValueError, RuntimeError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"{path}.params", f"cannot build {spec.arch} with {spec.params}: {e}") from None
        models[arch_key(spec)] = describe(built)
        if isinstance(built, WholeModel) and algo_cls.needs_embedding:
            hint = suggest_embedding(built)
            raise ConfigError(f"{path}.embedding",
                              f"{cfg.algorithm.name} needs the model's embedding, and {spec.arch} has no known "
                              f"body/head split: set {path}.embedding to the layer whose output is the embedding"
                              f"{f' (e.g. {hint!r}, the input of the last linear layer)' if hint else ''}, or give "
                              f"the module `features` (input -> embedding) and `classifier` (embedding -> logits) "
                              f"attributes, or return a raysim.models.SplitModel")
        if cfg.vectorizes() and cfg.train.local_steps is not None and issubclass(algo_cls, LocalTraining):
            raise ConfigError("train.local_steps", "is not supported with backend.vectorize (the vectorised "
                                                   "executor runs whole epochs); use local_epochs")
        if cfg.vectorizes():
            from raysim.runner.vectorized import check_model

            try:
                check_model(built, spec.arch)
            except ConfigError as e:
                if cfg.backend.vectorize != "auto":
                    raise
                raise ConfigError(e.field, f"{str(e).split(': ', 1)[1]} (backend.vectorize: auto trains "
                                           f"{cfg.algorithm.name}'s clients together on this device)") from None
    return models


def _make_algorithm(cfg: ExperimentConfig, algo_cls, params, task: Task):
    """The driver's instance of the method (schedules only; never trained): validated against the task, its
    schedules checked; a user's method runs under the dry-run guard (it may write nothing while being checked)."""
    import contextlib

    from raysim.config import dryrun
    from raysim.config.registry import installed_object

    guard = contextlib.nullcontext() if installed_object(algo_cls) else \
        dryrun.user_code("algorithm.name", f"the method {cfg.algorithm.name}")  # a dry run lets no user code write
    with guard:
        algorithm = algo_cls(params, task)
        algorithm.validate()
        schedules = (("schedule()", algorithm.schedule()), ("setup_schedule()", algorithm.setup_schedule()),
                     ("evaluation_schedule()", algorithm.evaluation_schedule()))
    for where, sched in schedules:
        check_schedule(sched, algorithm, where)
    return algorithm


def _check_state_dir(cfg: ExperimentConfig) -> None:
    """``backend.state_dir`` (where states spill) can be created or used: one ConfigError naming the key, before
    any data loads (without writing anything: a dry run checks it too)."""
    from pathlib import Path

    d = cfg.backend.state_dir
    if not d:
        return
    path = Path(os.path.expanduser(str(d)))
    if path.exists() and not path.is_dir():
        raise ConfigError("backend.state_dir", f"{d} is a file, not a directory; give a directory for the spilled "
                                               f"client states (created if missing), or leave it out for a "
                                               f"temporary one")
    anc = path
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise ConfigError("backend.state_dir", f"cannot create {d}: {anc} is a file, not a directory")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise ConfigError("backend.state_dir", f"cannot write to {anc} (permission denied); choose another "
                                               f"backend.state_dir")


def _instance_server_data(algorithm, algo_cls) -> tuple:
    """The server-held data sets the prepared method reads: its class's, plus ``global_test`` where a named option of
    its params asks for it (``Algorithm.declared_server_data``); any other addition is refused."""
    names = tuple(algorithm.declared_server_data())
    extra = set(names) - set(algo_cls.server_data)
    if extra - {"global_test"}:
        raise TypeError(f"{algo_cls.__name__}.declared_server_data adds {sorted(extra - {'global_test'})}; an "
                        f"instance may add only 'global_test' to its class's server_data")
    return names


def _check_server_data(cfg: ExperimentConfig, algo_cls) -> None:
    """Every server-held data set the method declares (``Algorithm.server_data``) is configured: one ConfigError
    naming the config field that provides it, before any data is loaded."""
    for name in algo_cls.server_data:
        if name not in SERVER_DATA or SERVER_DATA[name][0] is None:
            raise TypeError(f"{algo_cls.__name__}.server_data names {name!r}; the server-held data sets a class may "
                            f"declare are {', '.join(sorted(k for k, v in SERVER_DATA.items() if v[0]))}")
        path, hint = SERVER_DATA[name]
        value = cfg
        for part in path.split("."):
            value = getattr(value, part)
        if not value:
            raise ConfigError(path, f"{cfg.algorithm.name} needs the server-held data set {name!r} (its server steps "
                                    f"read it); set {path} to {hint}")


def _per_client_path(model_cfg, spec, i: int) -> str:
    """The per_client entry an architecture came from (its index in the list)."""
    for k, s in enumerate(model_cfg.per_client):
        if s.arch == spec.arch and dict(s.params) == dict(spec.params):
            return f"model.per_client[{k}]"
    return f"model.per_client[{i % len(model_cfg.per_client)}]"


def _available_bytes() -> Optional[int]:
    from raysim.data.datasets import available_memory

    return available_memory()


POPULATION_BYTES_PER_CLIENT = 640  # CSR offsets of train/test/val (24 B), the runners' masks, the driver's per-client
#                                    bookkeeping (sizes, domains, placement, the partitioner's per-client arrays): the
#                                    peak-RSS slope of a whole run measured ~600 B per client (iid with replace, 150k
#                                    and 300k clients, sequential backend; issue 35); nway_kshot's per-client Python
#                                    objects (its class lists, an array header per client and split) measured 389 B
#                                    per client beyond its indices (tracemalloc, 20k clients; issue 50)
INDEX_BYTES = 16  # one sample index (int64), held twice until the data is built: the partitioner's per-client arrays
#                   and the population's CSR copy of them (raysim.data.clients.csr)
POPULATION_SHARE = 0.5  # of the free memory a population's index data may take (the data pools and models need the rest)


def _kshot_floor(p: dict) -> int:
    """The fewest sample indices an nway_kshot client holds: n_i >= min(max(2, ways - stdev), ways + stdev) classes
    x k_i >= min(shots - stdev + 1, shots) shots (raysim.data.skew._kshot_draws), plus test_shots of each class."""
    ways, shots, stdev, test = (p.get(k) for k in ("ways", "shots", "stdev", "test_shots"))
    n = min(max(2, ways - stdev), ways + stdev)
    k = shots if stdev == 0 else min(shots - stdev + 1, shots)
    return max(0, n) * (max(0, k) + max(0, test))


def population_indices(cfg: ExperimentConfig) -> tuple[int, str]:
    """(sample indices every client holds at least, what they come from): partitioners that draw
    ``samples_per_client`` / ``test_per_client`` per client count those; nway_kshot its smallest client (from
    ``ways``, ``shots``, ``stdev``, ``test_shots``, with the partitioner's defaults); partitioners that split a pool
    without a per-client size count none (their index data is bounded by the pool). A lower bound: never more than
    the partitioner gives, so a population is refused only where even its smallest clients would not fit."""
    import inspect

    from raysim.data.partition import PARTITIONERS

    given = dict(cfg.data.partition_params or {})
    fn = PARTITIONERS.get(cfg.data.partition)
    p = {k: v.default for k, v in inspect.signature(fn).parameters.items()
         if v.default is not inspect.Parameter.empty} if fn is not None else {}
    p.update(given)
    if not all(isinstance(v, int) and not isinstance(v, bool) for k, v in p.items()
               if k in ("ways", "shots", "stdev", "test_shots")):
        return 0, ""  # refused with its key when the partitioner checks its parameters
    if cfg.data.partition == "nway_kshot":
        return _kshot_floor(p), " x ".join(f"{k} {p[k]}" for k in ("ways", "shots", "stdev", "test_shots"))
    per, keys = 0, []
    for key in ("samples_per_client", "test_per_client"):
        v = given.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
            per, keys = per + int(v), keys + [f"{key} {v}"]
    return per, " x ".join(keys)


def population_bytes(cfg: ExperimentConfig) -> int:
    """Estimate of the memory a population's client bookkeeping takes on the driver before any data is built:
    per-client index arrays (:func:`population_indices`, ``INDEX_BYTES`` per index) plus a fixed per-client
    overhead (``POPULATION_BYTES_PER_CLIENT``)."""
    per, _ = population_indices(cfg)
    return int(cfg.data.num_clients) * (INDEX_BYTES * per + POPULATION_BYTES_PER_CLIENT)


def _check_population_memory(cfg: ExperimentConfig, avail: Optional[int] = None) -> None:
    """Refuse, before any data is built, a population whose client bookkeeping alone would not fit in half of this
    machine's free memory, with the estimate and the keys to change."""
    need = population_bytes(cfg)
    avail = _available_bytes() if avail is None else avail
    if avail is not None and need > POPULATION_SHARE * avail:
        _, per = population_indices(cfg)
        raise ConfigError("data.num_clients", f"{cfg.data.num_clients:,} clients" + (f" ({per})" if per else "")
                          + f" need about {need / 2**30:,.1f} GiB for their index data and bookkeeping alone, more "
                          f"than half of the {avail / 2**30:,.1f} GiB free here; lower data.num_clients"
                          + (" or data.partition_params" if per else ""))


def _check_model_size(spec, task: Task, path: str) -> None:
    """Count the architecture's parameters without allocating them (torch's meta device) and refuse a model whose
    weights, gradients and optimiser state (4 copies of float32) would not fit in this machine's free memory."""
    import torch

    from raysim.models import build_model

    try:
        with torch.device("meta"):
            n = sum(p.numel() for p in build_model(spec, task.input_shape, task.num_classes, path).parameters())
    except ConfigError:
        raise
    except Exception:  # an architecture that cannot be built on the meta device is built (and checked) for real
        return
    need, avail = 16 * n, _available_bytes()
    if avail is not None and need > avail:
        raise ConfigError(f"{path}.params", f"{spec.arch} with {spec.params} has {n:,} parameters: about "
                                            f"{need / 2**30:,.1f} GiB for weights, gradients and optimiser state, "
                                            f"more than the {avail / 2**30:,.1f} GiB free here; make it smaller")


_NOTICED: set = set()


def _check_fixed_gemm(cfg: ExperimentConfig) -> None:
    """A portable vectorised run on a CPU computes its grouped convolutions with raysim's fixed-order GEMM
    (raysim/fixed_gemm.py: the same bits on every CPU, compiled at first use): where it cannot be built, one line
    before anything runs, rather than other kernels and another table (``auto`` never falls back by itself: what
    runs, and the run's identity, must not depend on whether the machine has a compiler)."""
    from raysim import fixed_gemm

    try:
        fixed_gemm.library()
    except fixed_gemm.KernelUnavailable as e:
        why = (f"auto trains {cfg.algorithm.name}'s clients together on a CPU, which needs the fixed-order GEMM: "
               if cfg.backend.vectorize == "auto" else "")
        raise ConfigError("backend.vectorize", f"{why}{e}; or run backend.numerics: native (the table then depends "
                                               f"on the CPU) or backend.vectorize: false") from None


def _notice_once(message: str) -> None:
    if message not in _NOTICED:  # prepare runs again per seed and per trial: say it once
        _NOTICED.add(message)
        rundir.notice(message)


_INERT_WHY = {  # why a backend switch does nothing for a run (raysim.algorithm.settings_without_effect)
    "vectorize": lambda cfg: "it is not a LocalTraining method and has no group form <fn>_group: its clients always "
                             "train one after another",
    "partial_aggregate": lambda cfg: "the env section decides after each step which uploads arrive, so uploads are "
                                     "never merged" if cfg.env is not None else
                                     "its aggregation declares no merge of uploads that applies",
}


def _notice_dropped(cfg: ExperimentConfig, notify: Callable[[str], None] = _notice_once) -> None:
    """Values the run caps or leaves unused get one line each (never silently)."""
    n = cfg.data.num_clients
    per = cfg.model.per_client
    if per is not None and cfg.model.assign in ("cycle", "blocks") and len(per) > n:
        unused = [f"{i}: {s.arch}" for i, s in enumerate(per) if i >= n]
        notify(f"note: model.per_client lists {len(per)} architectures but data.num_clients is {n}: entries "
               f"{', '.join(unused[:5])}{' ...' if len(unused) > 5 else ''} are not used")
    tiers = cfg.model.tiers
    if cfg.model.assign == "tier" and tiers is not None and len(tiers) > n:
        notify(f"note: model.tiers lists {len(tiers)} tiers but data.num_clients is {n}: the last {len(tiers) - n} "
               f"are not used")
    rot = cfg.data.rotations
    if rot is not None and len(rot) > n:
        notify(f"note: data.rotations lists {len(rot)} angles but data.num_clients is {n}: the last {len(rot) - n} "
               f"are not used")
    for key in cfg.inert_backend():
        if key == "vectorize" and cfg.backend.vectorize == "auto":  # the default on a GPU: the loop, said once
            notify(f"note: backend.vectorize: auto runs {cfg.algorithm.name} in the per-client loop on this GPU "
                   f"({_INERT_WHY[key](cfg)})")
            continue
        notify(f"note: backend.{key}: true does nothing for {cfg.algorithm.name} ({_INERT_WHY[key](cfg)}); it is "
               f"left out of the run's identity (run id {cfg.run_id()})")
    if cfg.backend.vectorize == "auto" and cfg._vectorize_on_cpu() and cfg.vectorizes() \
            and not cfg.backend.clients_on_gpu():
        notify(f"note: backend.vectorize: auto trains {cfg.algorithm.name}'s clients together on this CPU (its group "
               f"forms, the faster path here); backend.vectorize: false runs them one after another")
    if cfg.backend.name == "ray" and cfg.backend.num_actors > n:
        notify(f"note: backend.num_actors={cfg.backend.num_actors} exceeds data.num_clients={n}: {n} client actors "
               f"are started (one client each)")


def versions() -> dict:
    """The software versions, the code version (``code``: :func:`raysim.engine.provenance.code_version`) and the CPU model a
    run was made with (float reductions follow the CPU's vector unit: the same seed gives the same table on one CPU
    model, and last-bit differences across models)."""
    out = {"python": platform.python_version()}
    for pkg in ("raysim", "torch", "ray", "numpy", "pandas", "pyarrow"):
        try:
            out[pkg] = importlib_metadata.version(pkg)
        except importlib_metadata.PackageNotFoundError:
            out[pkg] = None
    out["cpu"] = numerics.cpu_model()
    # the code version (raysim's version, a digest of the packages' source, the git commit when there is one):
    # raysim reproduce reuses a finished run only when it equals this process's (raysim/engine/provenance.py)
    from raysim.engine.provenance import code_version

    out["code"] = dict(code_version())
    return out


def resume_hash(cfg: ExperimentConfig) -> str:
    """The identity a checkpoint is checked against: everything that changes the numbers except ``rounds``."""
    return cfg.config_hash(drop=("rounds",))



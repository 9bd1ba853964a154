"""Conformance checks for a federated method, importable by anyone who writes one (the ``optuna.testing`` idea).

Every shipped method passes them (tests/test_conformance.py, tests/test_privacy.py); a method registered with
``raysim.register_algorithm`` can run the same checks on its own small config::

    import raysim
    from raysim import testing

    raysim.register_algorithm("uniform_avg", "mymethod:UniformAvg")
    cfg = raysim.make_config({...,  "algorithm": {"name": "uniform_avg"}})
    testing.check_algorithm(cfg)              # all of the below on the sequential backend
    testing.check_sequential_equals_ray(cfg)  # and the Ray backend (starts a local Ray session if none is up)

Each ``check_*`` runs ``cfg`` (a config object or a config dict) end to end without writing a run directory (except
the resume check, in a temporary directory) and raises ``AssertionError`` with a message naming the check and what
differs. Tables are compared without their wall-time rows (``round_s``, ``step_s@*``). Use a config that runs in
seconds (a few rounds, a few clients): every check runs it at least once, the determinism check twice.

* :func:`check_runs` — the run finishes with finite values and reports ``test_acc``;
* :func:`check_determinism` — the same config and seed give the same table;
* :func:`check_spill` — every client state spilled to disk after each step (``backend.state_memory_mb: 0``) gives
  the same table;
* :func:`check_resume` — a run stopped after ``rounds - 1`` rounds and resumed from its checkpoint gives the table
  of the uninterrupted run;
* :func:`check_sequential_equals_ray` — the Ray backend (client actors, states spilled) gives the sequential table;
* :func:`check_message_accounting` — only the message kinds the method declares (``declared_uploads``) reach the
  server, and the bytes and floats the server received per client and round are the table's ``up_bytes`` and
  ``up_floats``;
* :func:`check_empty_round` — server and client states pickle, and a round in which nobody uploads leaves the
  server usable;
* :func:`check_algorithm` — all the sequential checks above, sharing one reference table;
* :func:`check_device_residence` — no operation mixes a host tensor with one on the run's device (what fails on a
  GPU, found on a CPU by :class:`DeviceGuard`), with the per-client loop and the vectorised executor.
"""
from __future__ import annotations

import math
import pickle
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import pandas as pd

from raysim.config import ExperimentConfig, make_config, set_dotted, to_dict
from raysim.errors import ConfigError

__all__ = ["DeviceGuard", "Upload", "check_algorithm", "check_determinism", "check_measures", "check_device_residence", "check_empty_round", "check_message_accounting",
           "check_resume", "check_runs", "check_sequential_equals_ray", "check_spill", "assert_same_table"]

ConfigLike = Union[ExperimentConfig, dict]


# -- helpers -----------------------------------------------------------------------------------------------------------

def _config(cfg: ConfigLike) -> ExperimentConfig:
    if isinstance(cfg, ExperimentConfig):
        return cfg
    if isinstance(cfg, dict):
        return make_config(cfg)
    raise TypeError(f"expected an ExperimentConfig or a config dict, got {type(cfg).__name__}")


def _variant(cfg: ExperimentConfig, **dotted) -> ExperimentConfig:
    """``cfg`` with the given keys set (``backend__state_memory_mb=0`` sets ``backend.state_memory_mb``), validated."""
    data = to_dict(cfg)
    for key, value in dotted.items():
        data = set_dotted(data, key.replace("__", "."), value)
    return make_config(data)


def _table(cfg: ExperimentConfig, **kw) -> pd.DataFrame:
    from raysim.engine.loop import run_experiment

    return run_experiment(cfg, write=False, **kw).table


def assert_same_table(expected: pd.DataFrame, got: pd.DataFrame, what: str) -> None:
    """The two result tables are identical but for their wall-time rows; else AssertionError saying ``what``."""
    from raysim.io.results import without_timing

    a, b = without_timing(expected), without_timing(got)
    try:
        pd.testing.assert_frame_equal(a, b)
    except AssertionError as e:
        key = ["round", "client_id", "scope", "metric"]
        hint = ""
        if list(a.columns) == list(b.columns) and set(key) <= set(a.columns):
            m = a.merge(b, on=key, how="outer", suffixes=("", "_got"), indicator=True)
            diff = m[(m["_merge"] != "both") | ((m["value"] != m["value_got"]) &
                                                ~(m["value"].isna() & m["value_got"].isna()))]
            if len(diff):
                hint = f"\nfirst differing rows (value = expected):\n{diff[key + ['value', 'value_got']].head(10)}"
        raise AssertionError(f"{what}: the tables differ ({e}){hint}") from None


# -- the checks --------------------------------------------------------------------------------------------------------

def check_runs(cfg: ConfigLike, table: Optional[pd.DataFrame] = None) -> pd.DataFrame:
    """The run finishes, every value in its table is finite and it reports ``test_acc``. Returns the table (``table``:
    check that one instead of running)."""
    cfg = _config(cfg)
    t = _table(cfg) if table is None else table
    values = t["value"]
    bad = t[~values.map(lambda v: math.isfinite(float(v)))]
    if len(bad):
        raise AssertionError(f"{cfg.algorithm.name}: non-finite values in the table:\n{bad.head(10)}")
    if not (t["metric"] == "test_acc").any():
        raise AssertionError(f"{cfg.algorithm.name}: the table has no test_acc row (evaluate_client reports none)")
    return t


def check_determinism(cfg: ConfigLike) -> pd.DataFrame:
    """Two runs of the same config and seed give the same table, finite and with ``test_acc`` (:func:`check_runs`).
    Returns the table, to serve as the reference of the other checks."""
    cfg = _config(cfg)
    first = check_runs(cfg)
    assert_same_table(first, _table(cfg), f"{cfg.algorithm.name}: determinism (two runs with seed {cfg.seed})")
    return first


def check_spill(cfg: ConfigLike, reference: Optional[pd.DataFrame] = None,
                state_dir: Union[str, Path, None] = None) -> pd.DataFrame:
    """With every client state spilled to disk after each step (``backend.state_memory_mb: 0``, in ``state_dir`` or a
    temporary directory) the table equals ``reference`` (default: a run of ``cfg``). Returns the spilled run's table."""
    cfg = _config(cfg)
    reference = _table(cfg) if reference is None else reference
    with tempfile.TemporaryDirectory(prefix="raysim-spill-") as tmp:
        spilled = _variant(cfg, backend__state_memory_mb=0, backend__state_dir=str(state_dir or Path(tmp) / "states"))
        t = _table(spilled)
    assert_same_table(reference, t, f"{cfg.algorithm.name}: states spilled to disk (backend.state_memory_mb: 0)")
    return t


def check_resume(cfg: ConfigLike, reference: Optional[pd.DataFrame] = None,
                 workdir: Union[str, Path, None] = None) -> pd.DataFrame:
    """A run stopped after ``rounds - 1`` rounds (a checkpoint every round) and resumed to ``rounds`` from its run
    directory (in ``workdir`` or a temporary directory) gives the table of the uninterrupted run ``reference``
    (default: a run of ``cfg``), run ids aside. Returns the resumed table."""
    from raysim.engine.loop import run_experiment

    cfg = _config(cfg)
    if cfg.rounds < 2:
        raise ConfigError("rounds", f"check_resume stops after rounds - 1 rounds and resumes: needs rounds >= 2, "
                                    f"got {cfg.rounds}")
    reference = _table(cfg) if reference is None else reference
    every = _variant(cfg, output__checkpoint_every=1, output__progress=False)
    short = _variant(every, rounds=cfg.rounds - 1)
    with tempfile.TemporaryDirectory(prefix="raysim-resume-") as tmp:
        run = Path(workdir or tmp) / "run"
        run_experiment(short, out_dir=run)
        resumed = run_experiment(every, resume=run, out_dir=run.with_name("resumed")).table
    assert_same_table(reference.drop(columns="run_id"), resumed.drop(columns="run_id"),
                      f"{cfg.algorithm.name}: stopped after round {cfg.rounds - 2} and resumed")
    return resumed


def check_sequential_equals_ray(cfg: ConfigLike, reference: Optional[pd.DataFrame] = None, num_actors: int = 2,
                                spill: bool = True) -> pd.DataFrame:
    """On the Ray backend (``num_actors`` client actors of 1 CPU each, at most one per client; ``spill``: every
    client state spilled to disk) the table equals the sequential ``reference`` (default: a run of ``cfg`` on the
    sequential backend). Starts a local Ray session when none is up. Returns the Ray table."""
    cfg = _config(cfg)
    if reference is None:
        reference = _table(_variant(cfg, backend__name="sequential"))
    actors = max(1, min(int(num_actors), cfg.data.num_clients))
    ray_cfg = _variant(cfg, backend__name="ray", backend__num_actors=actors, backend__num_cpus=1,
                       **({"backend__state_memory_mb": 0} if spill else {}))
    t = _table(ray_cfg)
    assert_same_table(reference, t, f"{cfg.algorithm.name}: Ray backend with {actors} actor(s)"
                                    f"{' and spilled states' if spill else ''} against the sequential backend")
    return t


@dataclass
class Upload:
    """One message that reached the server: its round, client, kind, size and tensors."""

    round: int
    client_id: int
    kind: str
    num_floats: int
    num_bytes: int
    tensors: list = field(default_factory=list, repr=False)


@contextmanager
def _server_spy(seen: list):
    """Records every upload handed to the (in-process) server runner; undone on exit."""
    from raysim.runner.runners import ServerRunner

    real = ServerRunner.run_server_step

    def spy(self, step, round_idx, iteration, failures, *groups, keep=None):
        for g in groups:
            for cid, payload in (g or {}).items():
                for msg in payload.values():
                    seen.append(Upload(round_idx, cid, msg.kind, msg.num_floats, msg.num_bytes,
                                       list(msg.tensors.values())))
        return real(self, step, round_idx, iteration, failures, *groups, keep=keep)

    ServerRunner.run_server_step = spy
    try:
        yield seen
    finally:
        ServerRunner.run_server_step = real


def check_message_accounting(cfg: ConfigLike) -> list:
    """On the sequential backend: the method declares its uploads (``declared_uploads()``), only those kinds reach
    the server, a method that declares uploads sends some, and per client and round the bytes and floats the server
    received are exactly the table's ``up_bytes`` and ``up_floats``. Returns the uploads seen (:class:`Upload`)."""
    from raysim.engine.prepare import prepare

    cfg = _config(cfg)
    # the server must see each client's own upload (no partial aggregates)
    cfg = _variant(cfg, backend__name="sequential", backend__partial_aggregate=False)
    name = cfg.algorithm.name
    declared = prepare(cfg).algorithm.declared_uploads()
    if declared is None:
        raise AssertionError(f"{name} does not declare its uploads (declared_uploads() returns None)")
    seen: list = []
    with _server_spy(seen):
        df = _table(cfg)
    kinds = {u.kind for u in seen}
    if not kinds <= set(declared):
        raise AssertionError(f"{name} uploads undeclared message kinds {sorted(kinds - set(declared))} "
                             f"(declared: {sorted(declared)})")
    client = df[df["scope"] == "client"]
    up = client[client["metric"] == "up_bytes"].set_index(["round", "client_id"])["value"]
    upf = client[client["metric"] == "up_floats"].set_index(["round", "client_id"])["value"]
    got_b, got_f = {}, {}
    for u in seen:
        key = (u.round, u.client_id)
        got_b[key] = got_b.get(key, 0) + u.num_bytes
        got_f[key] = got_f.get(key, 0) + u.num_floats
    for key, b in got_b.items():
        if key not in up.index or up[key] != b or upf[key] != got_f[key]:
            table_b = up.get(key, "no row")
            table_f = upf.get(key, "no row")
            raise AssertionError(f"{name}: round {key[0]}, client {key[1]}: the server received {b} bytes / "
                                 f"{got_f[key]} floats, the table accounts {table_b} / {table_f}")
    if declared and not got_b:
        raise AssertionError(f"{name} declares uploads {sorted(declared)} but sent nothing")
    if not declared and not up.eq(0).all():
        raise AssertionError(f"{name} declares no upload but the table accounts up_bytes:\n{up[up != 0].head()}")
    return seen


def check_empty_round(cfg: ConfigLike) -> None:
    """The initial server and client states pickle; an aggregation step in which nobody uploads (everyone dropped)
    returns a picklable payload (or none), and the clients then evaluate on it without error."""
    from raysim.engine.prepare import prepare
    from raysim.runner.runners import ClientRunner, ServerRunner, server_data
    from raysim.steps import CLASSIC_ROUND, EVALUATION

    cfg = _config(cfg)
    name = cfg.algorithm.name
    prep = prepare(cfg)
    server = ServerRunner(prep.spec, prep.fed_data.global_test, server_data(prep.spec, prep.fed_data))
    clients = ClientRunner(prep.spec, prep.fed_data.clients)
    for what, obj in (("server state", lambda: server.state),
                      ("client states", lambda: [clients.state(c) for c in clients.client_ids()])):
        try:
            pickle.dumps(obj())
        except Exception as e:
            raise AssertionError(f"{name}: the initial {what} do not pickle: {e!r}") from None
    payload, _ = server.run_server_step(CLASSIC_ROUND[1], 0, 0, [], {}, keep=[])
    payload = payload if payload is not None else server.initial_payload(1)
    try:
        pickle.dumps(payload)
    except Exception as e:
        raise AssertionError(f"{name}: the payload after a round without uploads does not pickle: {e!r}") from None
    _, reports = clients.run_client_step(EVALUATION[0], payload, 1, 0, clients.client_ids())
    failed = [r.error for r in reports if not r.ok]
    if failed:
        raise AssertionError(f"{name}: evaluation after a round without uploads failed: {failed[:3]}")


def is_accuracy(metric: str) -> bool:
    """The metrics whose model :meth:`raysim.algorithm.Algorithm.measures` must name: test accuracies (``test_acc*``,
    ``test_bwt``, ``test_fwt``) and the server's ``global_test_acc*``."""
    return metric.startswith(("test_acc", "global_test_acc")) or metric in ("test_bwt", "test_fwt")


def check_measures(cfg: ConfigLike, table: pd.DataFrame) -> None:
    """Every accuracy metric the run's table holds (client or server scope) is declared by the method's
    :meth:`~raysim.algorithm.Algorithm.measures` (which model it evaluates: ``raysim list``, and the refusal of
    ``raysim report`` / ``compare`` to compare metrics of different kinds), with a kind of
    :data:`raysim.algorithm.MEASURES`."""
    from raysim.algorithm import MEASURES
    from raysim.config.registry import algorithm_class

    cfg = _config(cfg)
    declared = algorithm_class(cfg.algorithm.name).measures(dict(cfg.algorithm.params))
    bad = sorted(k for k in declared.values() if k not in MEASURES)
    if bad:
        raise AssertionError(f"{cfg.algorithm.name}: measures() names unknown kinds {bad}; use {sorted(MEASURES)}")
    have = set(table.loc[table["scope"].isin(["client", "server"]), "metric"])
    missing = sorted(m for m in have if is_accuracy(m) and m not in declared)
    if missing:
        raise AssertionError(f"{cfg.algorithm.name} reports {missing} but measures() does not say which model they "
                             f"evaluate")


def check_algorithm(cfg: ConfigLike, workdir: Union[str, Path, None] = None) -> pd.DataFrame:
    """Every sequential check: :func:`check_determinism` (its table is the reference of the others),
    :func:`check_spill`, :func:`check_resume`, :func:`check_message_accounting`, :func:`check_empty_round`. Returns
    the reference table. (Ray: call :func:`check_sequential_equals_ray` with that table.)"""
    cfg = _config(cfg)
    if cfg.backend.name != "sequential":
        cfg = _variant(cfg, backend__name="sequential")
    reference = check_determinism(cfg)
    check_measures(cfg, reference)
    check_spill(cfg, reference, state_dir=None if workdir is None else Path(workdir) / "states")
    check_resume(cfg, reference, workdir=workdir)
    check_message_accounting(cfg)
    check_empty_round(cfg)
    return reference


# -- device residence: a stray host tensor found on a machine without a GPU --------------------------------------------

_FACTORIES = frozenset({"zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "randn", "rand", "randint",
                        "randperm", "eye", "linspace", "from_numpy"})
_MOVES = frozenset({"to", "cuda", "_to_copy"})
_PASSIVE = frozenset({"__setitem__", "__getitem__", "index_put_", "index_select", "copy_"})  # cross-device is legal


def _tensors_in(x, tensor_type, found: list) -> list:
    """The tensors in ``x`` and in the lists, tuples (named ones and torch's return types included) and dicts it
    nests, in order: what torch's pytree flattening finds in an operation's arguments and results (but for
    containers no torch operation takes, such as deques), at a fraction of its cost (DeviceGuard sees every operation
    of a run)."""
    if isinstance(x, tensor_type):
        found.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _tensors_in(y, tensor_type, found)
    elif isinstance(x, dict):
        for y in x.values():
            _tensors_in(y, tensor_type, found)
    return found


class DeviceGuard:
    """A TorchFunctionMode that finds, on a CPU, the operations that would mix devices on a GPU.

    Every tensor gets a home: ``dev`` when it was placed explicitly (``.to(device)``, ``.cuda()``, a factory given
    ``device=``, a module moved with ``.to``) or computed from such a tensor; ``host`` when a factory made it without
    ``device=`` (it lands on the CPU whatever the model's device) or ``.cpu()`` / ``.to("cpu")`` moved it back. An
    operation whose non-scalar tensor inputs have both homes is what CUDA refuses ("Expected all tensors to be on
    the same device"): it is recorded with the first raysim or method source line of the stack. Copies, indexing and
    0-dim tensors mix devices legally and are not checked; code inside ``torch.func`` transforms is skipped (its
    wrappers are new objects). On a CPU ``.to(device)`` returns the tensor itself, so it takes the ``dev`` home;
    ``.cpu()`` returns a new view carrying ``host`` (an alias, as on a CPU without the guard)."""

    def __init__(self, roots=None):
        import os

        import torch
        from torch.overrides import TorchFunctionMode

        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.roots = tuple(roots or (os.path.join(here, "raysim") + os.sep, os.path.join(here, "algorithms") + os.sep))
        self.home: dict = {}
        self.findings: dict = {}
        guard = self

        class _Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                return guard._call(func, args, kwargs or {})

        self._mode = _Mode()
        self._torch = torch
        from torch._C._functorch import is_batchedtensor, is_gradtrackingtensor

        self._functorch = (is_batchedtensor, is_gradtrackingtensor)

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)

    # homes by object identity (tensors compare by value, so no WeakKeyDictionary)
    def _get(self, t):
        e = self.home.get(id(t))
        return e[1] if e is not None and e[0]() is t else None

    def _set(self, t, tag: str) -> None:
        import weakref

        k, home = id(t), self.home
        try:
            ref = weakref.ref(t, lambda r, k=k: home.pop(k, None) if home.get(k, (None,))[0] is r else None)
        except TypeError:
            return
        home[k] = (ref, tag)

    def _call(self, func, args, kwargs):
        torch = self._torch
        is_batchedtensor, is_gradtrackingtensor = self._functorch
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        tens = _tensors_in((args, kwargs), torch.Tensor, [])
        if any(is_batchedtensor(t) or is_gradtrackingtensor(t) for t in tens):
            return out
        to_host = name == "cpu" or (name in _MOVES and any(isinstance(a, str) and a == "cpu" for a in args[1:]))
        if name in _FACTORIES:
            tag = "dev" if "device" in kwargs else "host"
        elif to_host:
            if args and out is args[0]:
                out = out.view_as(out)
            tag = "host"
        elif name in _MOVES and ("device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args[1:])):
            tag = "dev"
        else:
            homes = {self._get(t) for t in tens if t.dim() > 0}
            if "dev" in homes and "host" in homes and name not in _PASSIVE:
                self._record(name)
            tag = "dev" if "dev" in homes else ("host" if "host" in homes else None)
        if tag is not None:
            for o in _tensors_in(out, torch.Tensor, []):
                self._set(o, tag)
        return out

    def _record(self, name: str) -> None:
        import traceback

        for fr in reversed(traceback.extract_stack()[:-3]):
            if fr.filename.startswith(self.roots):
                key = f"{fr.filename.rsplit('/', 2)[-2]}/{fr.filename.rsplit('/', 1)[-1]}:{fr.lineno} {name}: {fr.line}"
                self.findings[key] = self.findings.get(key, 0) + 1
                return


def check_device_residence(cfg: ConfigLike, vectorize: Optional[bool] = None) -> None:
    """Run ``cfg`` (sequential backend) under :class:`DeviceGuard`, with the per-client loop and, where the method
    allows it, the vectorised executor: no operation may mix a host tensor with one on the run's device — what fails
    on a GPU with "Expected all tensors to be on the same device" fails here on a CPU."""
    from raysim.engine.loop import run_experiment

    base = _variant(_config(cfg), **{"backend.name": "sequential"})
    for vec in ((False, True) if vectorize is None else (vectorize,)):
        try:
            run_cfg = _variant(base, **{"backend.vectorize": vec})
        except ConfigError:
            continue  # the method or config cannot run vectorised (e.g. local_steps)
        with DeviceGuard() as guard:
            try:
                run_experiment(run_cfg, write=False, progress=False)
            except ConfigError:
                if not vec:
                    raise
                continue  # refused before it ran (e.g. train.local_steps is per-client-loop only)
        assert not guard.findings, (f"check_device_residence (vectorize={vec}): operations that mix host and device "
                                    f"tensors (fail on a GPU):\n" + "\n".join(f"  {k} (x{n})" for k, n in
                                                                               sorted(guard.findings.items())))

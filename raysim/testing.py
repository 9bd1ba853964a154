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
* :func:`check_algorithm` — all the sequential checks above, sharing one reference table.
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

from raysim.config import ConfigError, ExperimentConfig, make_config, set_dotted, to_dict

__all__ = ["Upload", "check_algorithm", "check_determinism", "check_empty_round", "check_message_accounting",
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
    from raysim.engine.runners import ServerRunner

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
    if cfg.backend.name != "sequential":
        cfg = _variant(cfg, backend__name="sequential")
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
    from raysim.engine.runners import ClientRunner, ServerRunner, server_data
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


def check_algorithm(cfg: ConfigLike, workdir: Union[str, Path, None] = None) -> pd.DataFrame:
    """Every sequential check: :func:`check_determinism` (its table is the reference of the others),
    :func:`check_spill`, :func:`check_resume`, :func:`check_message_accounting`, :func:`check_empty_round`. Returns
    the reference table. (Ray: call :func:`check_sequential_equals_ray` with that table.)"""
    cfg = _config(cfg)
    if cfg.backend.name != "sequential":
        cfg = _variant(cfg, backend__name="sequential")
    reference = check_determinism(cfg)
    check_spill(cfg, reference, state_dir=None if workdir is None else Path(workdir) / "states")
    check_resume(cfg, reference, workdir=workdir)
    check_message_accounting(cfg)
    check_empty_round(cfg)
    return reference

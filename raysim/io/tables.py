"""The result table's format: the long-format rows a run records (:class:`ResultTable`), written as one Parquet file
with the run's metadata under the key ``raysim`` and its sha256 in run.json, and read back verified (a damaged or
replaced table is one DamagedFileError naming the file, never silently wrong numbers); timing rows (``round_s``,
``step_s@<step>``) told apart from the deterministic ones. The pandas helpers over these tables are
:mod:`raysim.io.results` (``raysim.results``)."""
from __future__ import annotations

import json
import numbers
from pathlib import Path
from typing import NamedTuple

import pandas as pd

from raysim.io.files import file_sha256
from raysim.errors import MetricError

class Row(NamedTuple):
    """One row of a result table (the columns, in order)."""

    run_id: str
    round: int
    client_id: int
    scope: str
    metric: str
    value: float
    weight: float


COLUMNS = list(Row._fields)
META_KEY = b"raysim"
RESULTS_FILE = "results.parquet"
ROUND_TIME = "round_s"
STEP_TIME = "step_s@"  # + the step's name


def is_timing(metric: str) -> bool:
    """Whether ``metric`` is a wall-time row (``round_s``, ``step_s@<step>``), which differs from run to run."""
    return metric == ROUND_TIME or metric.startswith(STEP_TIME)


def without_timing(df: pd.DataFrame) -> pd.DataFrame:
    """The table without its wall-time rows (``round_s``, ``step_s@*``), index 0..n-1: what is identical between
    runs of one config and seed (backends, actors, spilling, resume)."""
    m = df["metric"].astype(str)
    keep = ~((m == ROUND_TIME) | m.str.startswith(STEP_TIME))
    return df[keep.to_numpy()].reset_index(drop=True)


def timing(df: pd.DataFrame) -> pd.DataFrame:
    """Per run and round: ``round_s`` and one ``step_s@<step>`` column per step (wall seconds on the driver)."""
    d = df[df["metric"].astype(str).map(is_timing) & (df["scope"] == "total")]
    if d.empty:
        raise MetricError("no timing rows (round_s) in this table")
    out = d.pivot_table(index=["run_id", "round"], columns="metric", values="value", aggfunc="sum")
    cols = [ROUND_TIME] + sorted(c for c in out.columns if c != ROUND_TIME)
    out = out[cols].reset_index()
    out.columns.name = None
    return out


class ResultTable:
    def __init__(self, run_id: str):
        self.run_id = run_id
        self.rows: list[Row] = []
        self.counts: set[str] = set()  # metrics recorded as integers (counts, bytes, floats sent): by type, not name

    def add(self, round_idx: int, client_id: int, scope: str, metric: str, value, weight: float = 1.0) -> None:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            self.counts.add(metric)
        self.rows.append(Row(self.run_id, int(round_idx), int(client_id), scope, metric, float(value), float(weight)))

    def frame(self) -> pd.DataFrame:
        df = pd.DataFrame(self.rows, columns=COLUMNS)
        return df.astype({"run_id": "string", "round": "int64", "client_id": "int64", "scope": "string",
                          "metric": "string", "value": "float64", "weight": "float64"})

    def latest(self, metric: str, scope: str = "mean"):
        for r in reversed(self.rows):
            if r.metric == metric and r.scope == scope:
                return r.value
        return None


def write_parquet(df: pd.DataFrame, path: Path, metadata: dict) -> str:
    """Write the table with page checksums (verified on read); returns the file's sha256, which the run directory
    records in run.json (``results_sha256``) so that a table damaged anywhere is never read as data."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pandas(df, preserve_index=False)
    meta = dict(table.schema.metadata or {})
    meta[META_KEY] = json.dumps(metadata, default=str).encode()
    pq.write_table(table.replace_schema_metadata(meta), path, write_page_checksum=True)
    return file_sha256(path)


# ----------------------------------------------------------------------------------------------------------------
# verified reading: a damaged table, run.json or metadata is one DamagedFileError naming the file

RUN_INFO = "run.json"
DIGEST_KEY = "results_sha256"
_TABLE_FIX = ("the run's results cannot be trusted: run it again (or restore the directory from a backup), or move "
              "the directory out of the way")
_verified: dict = {}  # (path, size, mtime_ns) -> True: a table checked once is not hashed again


def read_run_info(run_dir) -> dict | None:
    """A run directory's run.json (None when it has none, e.g. a result table copied on its own or an old run);
    a damaged one is a DamagedFileError naming it."""
    from raysim.errors import DamagedFileError, check_regular, read_problem

    path = Path(run_dir) / RUN_INFO
    if not path.exists() and not path.is_symlink():
        return None
    try:
        check_regular(path)  # a FIFO would block `raysim runs` forever
        info = json.loads(path.read_text())
        if not isinstance(info, dict):
            raise ValueError(f"expected a JSON object, got {type(info).__name__}")
    except Exception as e:
        raise DamagedFileError(path, read_problem(e), _TABLE_FIX) from None
    return info


def check_table(f) -> None:
    """Raise DamagedFileError unless result file ``f`` is a readable file whose sha256 matches the one its run
    recorded in run.json. Tables of old runs (no recorded digest) pass here; their page checksums, if any, are
    still verified when they are read."""
    import os
    import stat

    from raysim.errors import DamagedFileError, read_problem

    f = Path(f)
    try:
        st = os.stat(f)
    except OSError as e:
        raise DamagedFileError(f, read_problem(e), _TABLE_FIX) from None
    if not stat.S_ISREG(st.st_mode):
        raise DamagedFileError(f, "it is a directory, not a file" if stat.S_ISDIR(st.st_mode) else
                               "not a regular file", _TABLE_FIX)
    key = (str(f.absolute()), st.st_size, st.st_mtime_ns)
    if key in _verified:
        return
    info = read_run_info(f.parent) if f.name == RESULTS_FILE else None
    digest = (info or {}).get(DIGEST_KEY)
    if digest is not None and not (isinstance(digest, str) and len(digest) == 64
                                   and all(c in "0123456789abcdef" for c in digest)):
        raise DamagedFileError(f.parent / RUN_INFO, f"its {DIGEST_KEY} is {digest!r:.80}, not a sha256 digest (64 hex "
                                                    f"digits), so the table beside it cannot be verified", _TABLE_FIX)
    if digest:
        try:
            actual = file_sha256(f)
        except OSError as e:
            raise DamagedFileError(f, read_problem(e), _TABLE_FIX) from None
        if actual != digest:
            what = "empty" if st.st_size == 0 else f"{st.st_size:,} bytes"
            raise DamagedFileError(f, f"its contents changed since the run finished ({what}; sha256 differs from "
                                      f"{DIGEST_KEY} in {f.parent / RUN_INFO})", _TABLE_FIX)
    check_schema(f)
    _verified[key] = True


# the result table's schema: column -> the Arrow types it may hold (a table of other columns or types is damaged or
# not a raysim table, whatever its digest says)
SCHEMA = {"run_id": "string", "round": "integer", "client_id": "integer", "scope": "string", "metric": "string",
          "value": "number", "weight": "number"}


def _arrow_kind(t) -> str:
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    if pa.types.is_integer(t):
        return "integer"
    if pa.types.is_floating(t):
        return "number"
    return str(t)


def check_schema(f) -> None:
    """DamagedFileError naming ``f`` unless its columns are exactly :data:`SCHEMA`'s with those types (read from
    the Parquet footer: no data is loaded)."""
    import pyarrow.parquet as pq

    from raysim.errors import DamagedFileError, read_problem

    try:
        schema = pq.read_schema(f)
    except Exception as e:
        raise DamagedFileError(f, read_problem(e), _TABLE_FIX) from None
    names = [n for n in schema.names if not n.startswith("__index_level_")]
    if sorted(names) != sorted(SCHEMA):
        missing = [c for c in SCHEMA if c not in names]
        extra = [c for c in names if c not in SCHEMA]
        what = "; ".join(x for x in (f"no column {', '.join(missing)}" if missing else "",
                                     f"other column(s) {', '.join(map(repr, extra[:5]))}" if extra else "") if x)
        raise DamagedFileError(f, f"not a raysim result table ({what}; expected {', '.join(SCHEMA)})", _TABLE_FIX)
    wrong = [f"{c} holds {_arrow_kind(schema.field(c).type)}" for c, kind in SCHEMA.items()
             if _arrow_kind(schema.field(c).type) != kind and not (kind == "number" and
                                                                    _arrow_kind(schema.field(c).type) == "integer")]
    if wrong:
        raise DamagedFileError(f, f"not a raysim result table ({'; '.join(wrong)}; expected "
                                  f"{', '.join(f'{c}: {k}' for c, k in SCHEMA.items())})", _TABLE_FIX)


def read_table(f, columns=None) -> pd.DataFrame:
    """One verified result table (see :func:`check_table`); page checksums are verified too."""
    from raysim.errors import DamagedFileError, read_problem

    check_table(f)
    try:
        return pd.read_parquet(f, columns=columns, page_checksum_verification=True)
    except Exception as e:
        raise DamagedFileError(f, read_problem(e), _TABLE_FIX) from None


def read_table_metadata(f) -> dict:
    """The ``raysim`` metadata of one verified result table ({} when it has none)."""
    import pyarrow.parquet as pq

    from raysim.errors import DamagedFileError, read_problem

    check_table(f)
    try:
        meta = pq.read_schema(f).metadata or {}
        out = json.loads(meta[META_KEY]) if META_KEY in meta else {}
        if not isinstance(out, dict):
            raise ValueError("the raysim metadata is not a JSON object")
        return out
    except Exception as e:
        raise DamagedFileError(f, read_problem(e), _TABLE_FIX) from None


def result_files(paths) -> list[Path]:
    """The result files of finished runs: unfinished (``*.incomplete``) and hidden directories are never runs."""
    from raysim.io.rundir import is_listed_run_path, is_unfinished_name

    if isinstance(paths, (str, Path)):
        paths = [paths]
    files = []
    for p in paths:
        p = Path(p)
        if is_unfinished_name(p if p.is_dir() else p.parent):
            raise FileNotFoundError(f"{p} is an unfinished run, not a result (continue it with raysim run CONFIG "
                                    f"--resume {p if p.is_dir() else p.parent})")
        if p.is_dir():
            if (p / RESULTS_FILE).exists():
                files.append(p / RESULTS_FILE)
            else:
                files += [f for f in sorted(p.glob(f"**/{RESULTS_FILE}")) if is_listed_run_path(f.parent, p)]
        elif p.exists():
            files.append(p)
        else:
            raise FileNotFoundError(f"no result table at {p}")
    if not files:
        raise FileNotFoundError(f"no {RESULTS_FILE} of a finished run under {', '.join(map(str, paths))}")
    return files


def load(paths) -> pd.DataFrame:
    """Load one or many runs (run directories, result files, or a parent directory) into one long DataFrame. Every
    table is verified (:func:`check_table`): a damaged one is a DamagedFileError naming it, never data."""
    return pd.concat([read_table(f) for f in result_files(paths)], ignore_index=True)


def load_metadata(path) -> dict:
    return read_table_metadata(result_files(path)[0])

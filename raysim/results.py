"""Tidy, long-format result tables (one Parquet file per run) and helpers to analyse them with pandas.

Columns: run_id, round, client_id (-1 for server/summary rows), scope (client | server | mean | std | total),
metric, value, weight. Config, seed, versions and data-scaling notes live in the Parquet file metadata under the key
``raysim``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import numpy as np
import pandas as pd

COLUMNS = ["run_id", "round", "client_id", "scope", "metric", "value", "weight"]
META_KEY = b"raysim"
RESULTS_FILE = "results.parquet"


class ResultTable:
    def __init__(self, run_id: str):
        self.run_id = run_id
        self.rows: list[tuple] = []

    def add(self, round_idx: int, client_id: int, scope: str, metric: str, value, weight: float = 1.0) -> None:
        self.rows.append((self.run_id, int(round_idx), int(client_id), scope, metric, float(value), float(weight)))

    def frame(self) -> pd.DataFrame:
        df = pd.DataFrame(self.rows, columns=COLUMNS)
        return df.astype({"run_id": "string", "round": "int64", "client_id": "int64", "scope": "string",
                          "metric": "string", "value": "float64", "weight": "float64"})

    def latest(self, metric: str, scope: str = "mean"):
        for r in reversed(self.rows):
            if r[4] == metric and r[3] == scope:
                return r[5]
        return None


def write_parquet(df: pd.DataFrame, path: Path, metadata: dict) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pandas(df, preserve_index=False)
    meta = dict(table.schema.metadata or {})
    meta[META_KEY] = json.dumps(metadata, default=str).encode()
    pq.write_table(table.replace_schema_metadata(meta), path)


def _result_files(paths) -> list[Path]:
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            if (p / RESULTS_FILE).exists():
                files.append(p / RESULTS_FILE)
            else:
                files += sorted(p.glob(f"**/{RESULTS_FILE}"))
        elif p.exists():
            files.append(p)
        else:
            raise FileNotFoundError(f"no result table at {p}")
    if not files:
        raise FileNotFoundError(f"no {RESULTS_FILE} under {', '.join(map(str, paths))}")
    return files


def load(paths) -> pd.DataFrame:
    """Load one or many runs (run directories, result files, or a parent directory) into one long DataFrame."""
    return pd.concat([pd.read_parquet(f) for f in _result_files(paths)], ignore_index=True)


def load_metadata(path) -> dict:
    import pyarrow.parquet as pq

    f = _result_files(path)[0]
    meta = pq.read_schema(f).metadata or {}
    return json.loads(meta[META_KEY]) if META_KEY in meta else {}


# ----------------------------------------------------------------------------------------------------------------
# analysis helpers


def client_metric(df: pd.DataFrame, metric: str = "test_acc") -> pd.DataFrame:
    return df[(df["scope"] == "client") & (df["metric"] == metric)]


def per_round(df: pd.DataFrame, metric: str = "test_acc") -> pd.DataFrame:
    """Mean and std over clients of ``metric`` per run and round."""
    d = client_metric(df, metric)
    return d.groupby(["run_id", "round"])["value"].agg(["mean", "std", "count"]).reset_index()


def final(df: pd.DataFrame, metric: str = "test_acc") -> pd.DataFrame:
    """Per run: mean and std over clients at the last evaluated round."""
    pr = per_round(df, metric)
    return pr.loc[pr.groupby("run_id")["round"].idxmax()].reset_index(drop=True)


def best(df: pd.DataFrame, metric: str = "test_acc") -> pd.DataFrame:
    pr = per_round(df, metric)
    return pr.loc[pr.groupby("run_id")["mean"].idxmax()].reset_index(drop=True)


def communication(df: pd.DataFrame) -> pd.DataFrame:
    """Per run: mean per round and total over the run of floats and bytes sent up and down (all clients)."""
    d = df[(df["scope"] == "total") & df["metric"].isin(["up_floats", "up_bytes", "down_floats", "down_bytes"])]
    g = d.groupby(["run_id", "metric"])["value"]
    return pd.DataFrame({"per_round": g.mean(), "total": g.sum()}).reset_index()


def rounds_to_target(df: pd.DataFrame, target: float, metric: str = "test_acc") -> pd.DataFrame:
    pr = per_round(df, metric)
    out = []
    for run_id, g in pr.groupby("run_id"):
        hit = g[g["mean"] >= target]
        out.append({"run_id": run_id, "round": int(hit["round"].min()) if len(hit) else np.nan})
    return pd.DataFrame(out)


def env_time(df: pd.DataFrame, metric: str = "sim_time") -> pd.DataFrame:
    """Per run and round, an environment quantity (``sim_time``: cumulative simulated seconds at the round's end;
    ``sim_round_s``, ``kept``, ``dropped`` ...) from the rows the environment layer writes (scope ``env``)."""
    d = df[(df["scope"] == "env") & (df["metric"] == metric)]
    return d[["run_id", "round", "value"]].rename(columns={"value": metric}).reset_index(drop=True)


def accuracy_vs_sim_time(df: pd.DataFrame, metric: str = "test_acc") -> pd.DataFrame:
    """Mean/std over clients of ``metric`` per evaluated round, with the simulated time at that round's end."""
    pr = per_round(df, metric)
    t = env_time(df)
    if t.empty:
        raise ValueError("no simulated time in this table: the run had no env section")
    return pr.merge(t, on=["run_id", "round"], how="left")


def sim_time_to_target(df: pd.DataFrame, target: float, metric: str = "test_acc") -> pd.DataFrame:
    """Per run: the first evaluated round whose mean ``metric`` reaches ``target``, and the simulated time (seconds)
    and bytes (up + down, all clients) spent until the end of that round; NaN where the target is never reached."""
    avt = accuracy_vs_sim_time(df, metric)
    tot = df[(df["scope"] == "total") & df["metric"].isin(["up_bytes", "down_bytes"])]
    out = []
    for run_id, g in avt.groupby("run_id"):
        hit = g[g["mean"] >= target].sort_values("round")
        row = {"run_id": run_id, "target": target, "round": np.nan, "sim_time": np.nan, "bytes": np.nan}
        if len(hit):
            r = int(hit["round"].iloc[0])
            spent = tot[(tot["run_id"] == run_id) & (tot["round"] <= r)]["value"].sum()
            row.update(round=r, sim_time=float(hit["sim_time"].iloc[0]), bytes=float(spent))
        out.append(row)
    return pd.DataFrame(out)

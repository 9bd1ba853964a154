"""Golden result tables: one small run per registered method, saved from a known-good engine.

``python tests/golden/make_golden.py [names]`` rewrites them (showing each table's difference from the committed one
first; counts and bytes must not change); tests/test_golden.py checks that today's engine reproduces every
(round, client, scope, metric) value exactly, on every CPU (the runs use portable numerics, raysim/numerics.py).
Regenerate only in a commit that moves numbers on purpose, and say why in its message.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

import pandas as pd  # noqa: E402

from raysim.config import make_config  # noqa: E402

# methods that average whole models need one architecture; the others get a mixed pair (dropout in both)
HETERO = {"fedproto", "fedproto_uh", "fedtgp", "lgfedavg", "feddistill", "local"}


def golden_config(name: str) -> dict:
    cfg = {
        "name": f"golden-{name}",
        "seed": 11,
        "rounds": 3,
        "clients_per_round": 4,
        "data": {"dataset": "mnist5k", "num_clients": 6, "partition": "nway_kshot",
                 "partition_params": {"ways": 3, "shots": 12, "stdev": 1, "test_shots": 6}},
        "model": {"arch": "cnn_mnist", "params": {"embed_dim": 16}},
        "train": {"local_epochs": 2, "batch_size": 8, "lr": 0.05, "momentum": 0.5},
        "algorithm": {"name": name, "params": {}},
        "eval": {"every": 1},
        "backend": {"name": "sequential"},
        "output": {"progress": False},
    }
    if name in HETERO:
        cfg["model"] = {"assign": "cycle", "per_client": [
            {"arch": "cnn_mnist", "params": {"embed_dim": 16}},
            {"arch": "cnn4", "params": {"embed_dim": 16}}]}
    if name == "fedtgp":
        cfg["algorithm"]["params"] = {"server_epochs": 5, "margin_threshold": 1.0}
    if name == "slaugfl":
        cfg["algorithm"]["params"] = {"gen_steps": 10, "gen_channels": 16, "prep_epochs": 3}
        cfg["data"]["server_val"] = 200  # representatives chosen on a server-held validation set (issue 21)
    if name in ("pnicfl", "pnicfl_plus"):
        cfg["data"]["public"] = {"dataset": "fashion_mnist", "size": 300}
        # the table was made under the former default init (k-means, 10 k-means++ restarts), pinned here since the
        # default became the seed's random-user init (issue 34); the random init is tested in tests/test_clustered.py
        cfg["algorithm"]["params"] = {"num_clusters": 2, "pretrain_episodes": 5, "init": "kmeans++", "init_restarts": 10}
        cfg["train"]["lr"] = 0.01  # squared-distance logits diverge at 0.05
    if name in ("fedgen", "fedgen_ht"):
        # FedGen's generated-sample terms (alpha = beta = 10, x gen_batch / batch_size) diverge at lr 0.05 in this tiny
        # setting: train_loss 8,348 in round 1 under the former batch orders, NaN under the counter-based ones (issue 49)
        cfg["train"]["lr"] = 0.01
    if name == "ifca":
        cfg["algorithm"]["params"] = {"num_clusters": 2}
    if name == "fedfomo":
        cfg["data"]["val_fraction"] = 0.2
    if name in MUTUAL:  # the mutual-learning family: Rotated MNIST domains with the four-way local split, LeNet, Adam
        cfg["data"] = {"dataset": "mnist5k", "num_clients": 4, "partition": "shared_base",
                       "partition_params": {"per_class": 10}, "rotations": [0, 20, 40, 60],
                       "local_split": {"public": 0.1, "val": 0.1, "test": 0.15}}
        cfg["model"] = {"arch": "lenet"}
        cfg["train"] = {"optimizer": "adam", "lr": 1e-3, "weight_decay": 1e-4, "batch_size": 8,
                        "persist_optimizer": True, "local_steps": 3}
        cfg["algorithm"]["params"] = dict(MUTUAL[name])
    return cfg


MUTUAL = {"mafml": {"iterations": 3}, "ind": {}, "agg": {}, "fml": {}, "fedkd": {"ramp_rounds": 3},
          "fedmd": {"n_alignment": 30, "digest_batch": 16, "transfer_public_epochs": 1, "transfer_private_epochs": 1}}


def made_with() -> dict:
    """What an exact comparison depends on, recorded beside each table (``<name>.json``): the numerics mode (portable:
    one kernel choice on every CPU, raysim/numerics.py) and the versions of the packages that compute. The CPU is
    recorded for information only: a portable table is the same on every CPU with AVX2."""
    from raysim.engine.prepare import versions

    v = versions()
    return {"numerics": "portable", "torch": v["torch"], "numpy": v["numpy"], "made_on": v["cpu"]}


EXACT_KEYS = ("numerics", "torch", "numpy")


def record_file(name: str) -> Path:
    return HERE / f"{name}.json"


def recorded(name: str):
    """``<name>.json``: what the table was made with and which metrics are counts (recorded as integers)."""
    f = record_file(name)
    return json.loads(f.read_text()) if f.exists() else None


def run_golden(name: str):
    """(table without wall times and run_id, the run's count metrics) of ``name``'s golden run."""
    from raysim.engine.loop import run_experiment
    from raysim.io.results import without_timing

    res = run_experiment(make_config(golden_config(name)), write=False)
    return without_timing(res.table).drop(columns=["run_id"]), list(res.metadata["count_metrics"])


KEY = ["round", "client_id", "scope", "metric"]


def difference(new, old, counts) -> tuple[list[str], bool]:
    """Lines describing how table ``new`` differs from ``old`` (per metric: rows added/removed, values changed and
    the largest change), and whether any count metric (recorded as an integer: bytes, floats sent, participants)
    or weight changed."""
    m = new.merge(old, on=KEY, how="outer", suffixes=("", "_old"), indicator=True)
    lines, counts_moved = [], False
    for metric, g in m.groupby("metric", sort=True):
        added, removed = int((g["_merge"] == "left_only").sum()), int((g["_merge"] == "right_only").sum())
        both = g[g["_merge"] == "both"]
        same = (both["value"] == both["value_old"]) | (both["value"].isna() & both["value_old"].isna())
        wsame = both["weight"] == both["weight_old"]
        changed = int((~same).sum())
        if not (added or removed or changed or (~wsame).any()):
            continue
        delta = (both["value"] - both["value_old"]).abs()[~same]
        kind = "count" if metric in counts else "float"
        lines.append(f"  {metric} ({kind}): {changed} of {len(both)} values changed"
                     + (f", largest |change| {delta.max():.3g}" if changed else "")
                     + (f", {added} rows added" if added else "") + (f", {removed} rows removed" if removed else "")
                     + (f", {int((~wsame).sum())} weights changed" if (~wsame).any() else ""))
        counts_moved |= kind == "count" and bool(changed or added or removed) or bool((~wsame).any())
    return lines, counts_moved


def names() -> list[str]:
    from raysim.config.registry import ALGORITHMS

    return sorted(n for n, target in ALGORITHMS.items() if target.startswith("algorithms."))  # not test-only ones


def main() -> None:
    """``make_golden.py [names] [--counts-changed]``: regenerate tables (numbers moved on purpose). Each table's
    difference from the committed one is printed before it is written; a table whose counts, bytes or weights
    changed is not written unless ``--counts-changed`` says that was meant (message sizes are the engine's contract)."""
    args = sys.argv[1:]
    allow_counts = "--counts-changed" in args
    only = [a for a in args if not a.startswith("--")]
    unknown = set(only) - set(names())
    if unknown:
        sys.exit(f"make_golden.py: no such method: {', '.join(sorted(unknown))}")
    refused = []
    for name in names():
        if only and name not in only:
            continue
        table, counts = run_golden(name)
        path = HERE / f"{name}.parquet"
        if path.exists():
            lines, counts_moved = difference(table, pd.read_parquet(path), set(counts))
            print(f"{name}: {'identical to the committed table' if not lines else 'differs from the committed table:'}")
            for ln in lines:
                print(ln)
            if counts_moved and not allow_counts:
                refused.append(name)
                print(f"{name}: NOT written: counts, bytes or weights changed (pass --counts-changed if meant)")
                continue
        else:
            print(f"{name}: new table, {len(table)} rows")
        table.to_parquet(path, index=False)
        record_file(name).write_text(json.dumps({**made_with(), "count_metrics": counts}, indent=1) + "\n")
    if refused:
        sys.exit(f"make_golden.py: not written (counts changed): {', '.join(refused)}")


if __name__ == "__main__":
    main()

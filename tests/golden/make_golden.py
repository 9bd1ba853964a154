"""Golden result tables: one small run per registered method, saved from a known-good engine.

``python tests/golden/make_golden.py`` rewrites them; tests/test_golden.py checks that today's engine reproduces every
(round, client, scope, metric) value exactly. Regenerate only in a commit that moves numbers on purpose, and say why
in its message.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

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
        cfg["algorithm"]["params"] = {"num_clusters": 2, "pretrain_episodes": 5}
        cfg["train"]["lr"] = 0.01  # squared-distance logits diverge at 0.05
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


def platform() -> dict:
    """The CPU the golden tables were made on: float reductions (a loss's mean, a matmul) take a different order on
    a different vector unit, so the last bits of some values are the CPU's, not the engine's."""
    import torch

    model, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = val.strip()
            if key.strip() == "flags" and not flags:
                flags = set(val.split())
    except OSError:
        import platform as pf

        model = pf.processor() or pf.machine()
    isa = [f for f in ("avx512f", "avx2", "fma", "neon", "asimd") if f in flags]
    return {"cpu": model, "isa": isa, "torch": torch.__version__.split("+")[0]}


def platform_file(name: str) -> Path:
    """Where the CPU a golden table was made on is recorded (one file per table: regenerating one table on another
    machine never relabels the others)."""
    return HERE / f"{name}.platform.json"


def recorded_platform(name: str):
    """The platform ``name``'s table was made on: its own file, else the shared platform.json of older tables."""
    for f in (platform_file(name), HERE / "platform.json"):
        if f.exists():
            return json.loads(f.read_text())
    return None


def cpu_slug(p: dict) -> str:
    """A file-name tag for a platform: ``amd-epyc``, ``intel-r-xeon-r-processor``."""
    import re

    return re.sub(r"[^a-z0-9]+", "-", p["cpu"].lower()).strip("-") or "unknown"


def golden_tables(name: str) -> list[tuple[Path, dict]]:
    """(table, platform it was made on) for ``name``: the main table ``<name>.parquet`` first, then the variants
    ``<name>@<cpu>.parquet`` made by ``--variant`` on other CPUs (methods whose numbers leave the cross-CPU tolerance
    within the golden run's three rounds, e.g. FedGen's generator, need the exact table of each CPU CI runs on)."""
    out = [(HERE / f"{name}.parquet", recorded_platform(name))]
    for f in sorted(HERE.glob(f"{name}@*.parquet")):
        out.append((f, json.loads(f.with_suffix(".platform.json").read_text())))
    return out


def names() -> list[str]:
    from raysim.registry import ALGORITHMS

    return sorted(n for n, target in ALGORITHMS.items() if target.startswith("algorithms."))  # not test-only ones


def main() -> None:
    """``make_golden.py [names]``: regenerate the main tables (numbers moved on purpose): the other CPUs' variants of
    those names are removed, being stale (other CPUs then compare within the tolerance until a variant is made there).
    ``make_golden.py --variant names``: add this CPU's exact table beside a main table made on another CPU, from an
    unchanged engine (the main table still guards the engine on its own CPU)."""
    from raysim.engine.loop import run_experiment
    from raysim.io.results import without_timing

    args = sys.argv[1:]
    variant = "--variant" in args
    only = [a for a in args if a != "--variant"]
    if variant and not only:
        sys.exit("make_golden.py --variant needs the names of the tables to add a variant of")
    here = platform()
    for name in names():
        if only and name not in only:
            continue
        if variant and recorded_platform(name) == here:
            sys.exit(f"{name}: the main table was made on this CPU; a variant would duplicate it")
        res = run_experiment(make_config(golden_config(name)), write=False)
        table = without_timing(res.table).drop(columns=["run_id"])  # wall times differ run to run
        if variant:
            path = HERE / f"{name}@{cpu_slug(here)}.parquet"
            table.to_parquet(path, index=False)
            path.with_suffix(".platform.json").write_text(json.dumps(here, indent=1) + "\n")
        else:
            table.to_parquet(HERE / f"{name}.parquet", index=False)
            platform_file(name).write_text(json.dumps(here, indent=1) + "\n")
            for old in HERE.glob(f"{name}@*"):
                old.unlink()
        print(name, len(res.table), "(variant)" if variant else "")


if __name__ == "__main__":
    main()

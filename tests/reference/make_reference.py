"""The portable quick-start table every machine must reproduce bit for bit (tests/test_numerics.py).

    python tests/reference/make_reference.py    # writes fedproto_mnist5k_r10_portable.parquet and its .json

The quick-start config, 10 rounds, sequential backend, on the CPU, portable numerics (the default). Made on the
machine named in the .json; tests/test_numerics.py compares it exactly on every machine (skipping, with the reason,
only where torch or numpy differ from the versions recorded there). Regenerate only when numbers move on purpose."""
from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))

OVERRIDES = ["rounds=10", "backend.name=sequential", "backend.device=cpu", "output.progress=false"]
NAME = "fedproto_mnist5k_r10_portable"


def run():
    import raysim
    from raysim.engine.loop import run_experiment
    from raysim.io.results import without_timing

    cfg = raysim.load_config(str(ROOT / "configs" / "fedproto_mnist5k.yaml"), OVERRIDES)
    res = run_experiment(cfg, write=False)
    return without_timing(res.table).drop(columns=["run_id"]).reset_index(drop=True), res


def main():
    from raysim.engine.prepare import versions

    table, res = run()
    table.to_parquet(HERE / f"{NAME}.parquet", index=False)
    v = versions()
    rec = {"config": "configs/fedproto_mnist5k.yaml", "overrides": OVERRIDES, "numerics": res.metadata["numerics"],
           "torch": v["torch"], "numpy": v["numpy"], "python": v["python"], "made_on": v["cpu"],
           "final_test_acc": res.final()[0], "rows": len(table)}
    (HERE / f"{NAME}.json").write_text(json.dumps(rec, indent=1) + "\n")
    print(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()

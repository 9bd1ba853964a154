"""Run the golden FedAvg config in a fresh process and write its table (a Parquet file) and the process's numerics
(a JSON file): tests/test_numerics.py starts it with other kernel settings in the environment, as another machine
would have. ``python tests/numerics_probe.py OUT_PREFIX [early]``; ``early`` runs a torch kernel before importing
raysim (the pin cannot take any more)."""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

if __name__ == "__main__":
    out = Path(sys.argv[1])
    if "early" in sys.argv[2:]:
        import torch

        torch.ones(8).sum()  # fixes torch's CPU capability before raysim can pin it
    import os

    from raysim.config import make_config
    from raysim.engine.loop import run_experiment
    from raysim.errors import ConfigError
    from raysim.io.results import without_timing
    from tests.golden.make_golden import golden_config

    cfg = golden_config("fedavg")
    cfg["backend"]["numerics"] = os.environ.get("RAYSIM_NUMERICS", "portable")
    try:
        res = run_experiment(make_config(cfg), write=False)
    except ConfigError as e:
        out.with_suffix(".json").write_text(json.dumps({"error": str(e)}))
        sys.exit(2)
    without_timing(res.table).drop(columns=["run_id"]).to_parquet(out.with_suffix(".parquet"), index=False)
    # and whether the run loaded torch._dynamo (raysim.training's optimisers avoid it: 1 s and 150 MB a process)
    out.with_suffix(".json").write_text(json.dumps(dict(res.metadata["numerics"],
                                                        dynamo_loaded="torch._dynamo" in sys.modules)))

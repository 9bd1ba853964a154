"""One fresh Python process for the checks that need one (nothing imported before them; tests/conftest.py's
``fresh_process`` fixture runs it once per test session and worker, and the tests read its JSON report):

* what ``import raysim`` (with raysim.numerics) loads — no torch — and then the Ray actor module — no pandas, no
  raysim.app (tests/test_layers.py);
* ``raysim list`` (the command line's main, as ``python -m raysim.app.cli list`` runs it) (tests/test_cli.py);
* make_optimizer's SGD and Adam stepped and saved without importing torch._dynamo (tests/test_lean_methods.py);
* ``raysim run`` of configs that ask for GPUs on a machine without any: exit 2 and one line each, before Ray starts
  (tests/test_cli.py; the test session's own Ray declares fake GPUs, so this needs a plain process; not where CUDA
  is visible).

    python tests/fresh_process.py REPORT.json '[["c0.yaml", "--out", "out0"], ...]'
"""
import contextlib
import importlib
import io
import json
import sys

if __name__ == "__main__":
    report, runs = sys.argv[1], json.loads(sys.argv[2])
    out = {}
    importlib.import_module("raysim")
    importlib.import_module("raysim.numerics")

    out["torch_after_import_raysim"] = sorted(m for m in sys.modules if m.split(".")[0] == "torch")
    importlib.import_module("raysim.backends.ray_actors")

    out["app_or_pandas_after_actor_module"] = sorted(m for m in sys.modules
                                                     if m.startswith("raysim.app") or m.split(".")[0] == "pandas")
    from raysim.app.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        out["list_exit"] = main(["list"])
    out["list"] = buf.getvalue()
    # make_optimizer's SGD and Adam: a step, zero_grad and a state_dict round trip import no torch._dynamo
    import torch

    from raysim.training import OptimizerSpec, make_optimizer

    model = torch.nn.Linear(3, 2)
    for spec in (OptimizerSpec("sgd", 0.1, momentum=0.9, weight_decay=0.01), OptimizerSpec("adam", 0.01)):
        opt = make_optimizer(model.parameters(), spec)
        model(torch.ones(4, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
        make_optimizer(model.parameters(), spec).load_state_dict(opt.state_dict())
    out["dynamo_after_optimisers"] = "torch._dynamo" in sys.modules
    out["runs"] = []
    if torch.cuda.is_available():  # RAYSIM_TEST_CUDA=1 on a GPU machine: the GPU requests would run
        runs = []
    for args in runs:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(["run", *args])
        out["runs"].append({"exit": code, "stderr": err.getvalue(), "ray_started": "ray" in sys.modules
                            and sys.modules["ray"].is_initialized()})
    with open(report, "w") as f:
        json.dump(out, f)

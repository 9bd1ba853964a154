"""The peer workload in Flower's simulation (``flwr.simulation.run_simulation``, Ray backend), called by
``benchmarks/peers/run.py --flower-python PY``. Runs in its own virtual environment because Flower pins its own Ray:

    python3 -m venv --system-site-packages /tmp/flwr-venv && /tmp/flwr-venv/bin/pip install "flwr[simulation]"

(``--system-site-packages`` reuses this machine's torch; the venv's own Ray shadows the system one.)
Usage: PY flower_fedavg.py '<workload json>' ROUNDS [run_simulation|start_simulation]  -> prints ``ROUND_TIMES [s, ...]``.

Two of Flower's simulation entry points: ``run_simulation`` (ServerApp/ClientApp, the current API; default) and the
legacy ``start_simulation`` (strategy + ``client_fn`` on Ray's virtual client engine), with the same client code.

Same data, model, optimiser and epoch as the raysim and plain-loop variants: the clients' tensors and the model are
built by raysim's own data layer and model zoo (imported read-only; raysim's Ray backend is not used here). FedAvg,
every client every round (fraction_fit 1), no federated evaluation (fraction_evaluate 0), 1 CPU per client task on
a 2-CPU Ray cluster, 1 torch thread per worker. Round time: between consecutive ``configure_fit`` calls of the
strategy (one round = configure, every client's fit, aggregate).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

W = json.loads(sys.argv[1]) if len(sys.argv) > 1 else None
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
API = sys.argv[3] if len(sys.argv) > 3 else "run_simulation"
_CACHE: dict = {}


def _prepared():
    """Data and a model, built once per worker process (as a Flower user would cache a dataset)."""
    if "prep" not in _CACHE:
        import run as peers  # benchmarks/peers/run.py: the shared workload definition

        torch.set_num_threads(1)
        prep, data = peers._data(W, ROUNDS)
        _CACHE["prep"], _CACHE["data"] = prep, data
        _CACHE["model"] = prep.task.build_model(0)
    return _CACHE


def client_fn(context):
    from flwr.client import NumPyClient

    c = _prepared()
    cid = int(context.node_config["partition-id"])
    x, y = c["data"][cid]
    model = c["model"]
    names = list(model.state_dict())

    class Client(NumPyClient):
        def fit(self, parameters, config):
            model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in zip(names, parameters)})
            model.train()
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
            perm = torch.randperm(len(y))
            for s in range(0, len(y), W["batch"]):
                idx = perm[s:s + W["batch"]]
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                opt.step()
            return [v.detach().numpy() for v in model.state_dict().values()], len(y), {}

    return Client().to_client()


def main():
    from flwr.client import ClientApp
    from flwr.common import ndarrays_to_parameters
    from flwr.server import ServerApp, ServerAppComponents, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.simulation import run_simulation

    stamps: list[float] = []

    class Timed(FedAvg):
        def configure_fit(self, server_round, parameters, client_manager):
            stamps.append(time.perf_counter())
            return super().configure_fit(server_round, parameters, client_manager)

        def aggregate_fit(self, server_round, results, failures):
            out = super().aggregate_fit(server_round, results, failures)
            if server_round == ROUNDS:
                stamps.append(time.perf_counter())
            return out

    init = [v.detach().numpy() for v in _prepared()["model"].state_dict().values()]
    n = W["clients"]
    strategy = Timed(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=n, min_available_clients=n,
                     initial_parameters=ndarrays_to_parameters(init))

    def server_fn(context):
        return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=ROUNDS))

    if API == "start_simulation":
        from flwr.simulation import start_simulation

        start_simulation(client_fn=client_fn, num_clients=n, config=ServerConfig(num_rounds=ROUNDS), strategy=strategy,
                         client_resources={"num_cpus": 1, "num_gpus": 0.0},
                         ray_init_args={"num_cpus": 2, "include_dashboard": False})
    else:
        run_simulation(server_app=ServerApp(server_fn=server_fn), client_app=ClientApp(client_fn=client_fn),
                       num_supernodes=n, backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                                         "init_args": {"num_cpus": 2, "include_dashboard": False}})
    times = [b - a for a, b in zip(stamps, stamps[1:])]
    print("ROUND_TIMES " + json.dumps(times), flush=True)


if __name__ == "__main__":
    main()

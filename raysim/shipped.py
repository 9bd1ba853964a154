"""What raysim ships, by name: the methods (``algorithm.name``), the backends (``backend.name``) and their
preflight checks, and the simulated environment (``env``). Registered by the package face (raysim/__init__.py)
when raysim is imported, so in every process before anything resolves a name.

The tables point down from the top: the registry (raysim/config/registry.py) sits below the contract and the
methods, the engine's backend interface (raysim/engine/backend.py) below the backends, and neither names what sits
above it (tests/test_layers.py reads these strings as the imports they become). Only strings here: nothing is
imported until a run resolves a name (``import raysim`` loads no torch)."""
from __future__ import annotations

from raysim.config import registry
from raysim.engine import backend

ALGORITHMS = {
    "local": "algorithms.local:Local",
    "fedavg": "algorithms.fedavg:FedAvg",
    "fedavg_uh": "algorithms.fedavg_uh:FedAvgUH",
    "fedproto": "algorithms.fedproto:FedProto",
    "fedproto_uh": "algorithms.fedproto_uh:FedProtoUH",
    "fedtgp": "algorithms.fedtgp:FedTGP",
    "fedprox": "algorithms.fedprox:FedProx",
    "fedper": "algorithms.fedper:FedPer",
    "lgfedavg": "algorithms.lgfedavg:LGFedAvg",
    "fesem": "algorithms.fesem:FeSEM",
    "feddistill": "algorithms.feddistill:FedDistill",
    "scaffold": "algorithms.scaffold:Scaffold",
    "moon": "algorithms.moon:Moon",
    "slaugfl": "algorithms.slaugfl:SlaugFL",
    "fedgen": "algorithms.fedgen:FedGen",
    "fedgen_ht": "algorithms.fedgen_ht:FedGenHt",
    "vhl": "algorithms.vhl:VHL",
    "pnicfl": "algorithms.pnicfl:PNICFL",
    "pnicfl_plus": "algorithms.pnicfl:PNICFLPlus",
    "ifca": "algorithms.ifca:IFCA",
    "fedfomo": "algorithms.fedfomo:FedFomo",
    "mafml": "algorithms.mafml:MAFML",
    "ind": "algorithms.mutual_baselines:Ind",
    "agg": "algorithms.mutual_baselines:Agg",
    "fml": "algorithms.fml:FML",
    "fedkd": "algorithms.fedkd:FedKD",
    "fedmd": "algorithms.fedmd:FedMD",
}
BACKENDS = {"sequential": "raysim.backends.sequential:SequentialBackend",
            "ray": "raysim.backends.ray_backend:RayBackend"}
PREFLIGHT = "raysim.backends:preflight"
ENVIRONMENT = "envs:Environment"


def register() -> None:
    """Make the shipped names known (a user's own registrations, made later, add to them or replace them)."""
    for name, target in ALGORITHMS.items():
        registry.ALGORITHMS.setdefault(name, target)
    if not registry.ENVIRONMENT["target"]:
        registry.register_environment(ENVIRONMENT)
    for name, target in BACKENDS.items():
        backend.BACKENDS.setdefault(name, target)
    if not backend.PREFLIGHT["target"]:
        backend.register_preflight(PREFLIGHT)

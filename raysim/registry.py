"""Name registry: the only way the engine reaches the method modules (``"fedproto"`` -> ``algorithms.fedproto``)."""
from __future__ import annotations

import importlib

from raysim.config import ConfigError

ALGORITHMS: dict[str, str] = {
    "local": "algorithms.local:Local",
    "fedavg": "algorithms.fedavg:FedAvg",
    "fedproto": "algorithms.fedproto:FedProto",
    "fedproto_uh": "algorithms.fedproto_uh:FedProtoUH",
    "fedtgp": "algorithms.fedtgp:FedTGP",
    "fedprox": "algorithms.fedprox:FedProx",
    "fedper": "algorithms.fedper:FedPer",
    "lgfedavg": "algorithms.lgfedavg:LGFedAvg",
    "fesem": "algorithms.fesem:FeSEM",
    "feddistill": "algorithms.feddistill:FedDistill",
}


def register_algorithm(name: str, target: str) -> None:
    """Register ``"module.path:ClassName"`` under ``name`` (for methods that live outside this repository)."""
    ALGORITHMS[name] = target


def algorithm_class(name: str):
    if name not in ALGORITHMS:
        raise ConfigError("algorithm.name", f"{name!r} is not allowed; choose one of: {', '.join(sorted(ALGORITHMS))}")
    module, cls = ALGORITHMS[name].split(":")
    return getattr(importlib.import_module(module), cls)

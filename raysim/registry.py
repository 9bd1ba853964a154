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
    "scaffold": "algorithms.scaffold:Scaffold",
    "moon": "algorithms.moon:Moon",
    "slaugfl": "algorithms.slaugfl:SlaugFL",
    "fedgen": "algorithms.fedgen:FedGen",
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


ENVIRONMENT = "envs:Environment"  # the simulated environment (device, network, participation, clock)


def make_environment(cfg, fed_data):
    """The run's simulated environment, or None when the config has no ``env`` section (envs is imported lazily)."""
    if cfg.env is None:
        return None
    module, cls = ENVIRONMENT.split(":")
    return getattr(importlib.import_module(module), cls).from_experiment(cfg, fed_data)


def register_algorithm(name: str, target: str) -> None:
    """Register ``"module.path:ClassName"`` under ``name`` (for methods that live outside this repository)."""
    ALGORITHMS[name] = target


def algorithm_target(name: str) -> str:
    if name not in ALGORITHMS:
        raise ConfigError("algorithm.name", f"{name!r} is not allowed; choose one of: {', '.join(sorted(ALGORITHMS))}")
    return ALGORITHMS[name]


def load_target(target: str):
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)


def algorithm_class(name: str):
    return load_target(algorithm_target(name))

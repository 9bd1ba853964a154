"""What each metric measures, per method (issue 52): ``raysim list``'s lines, and the check of ``raysim report`` and
``raysim compare`` that one metric name means one kind of model across the methods compared (FedAvg's ``test_acc``
scores the global model, FedProto's the client's own; FedProto's ``test_acc_proto`` picks among the client's own
classes, FedTGP's among all). The kinds are declared by each method (:meth:`raysim.algorithm.Algorithm.measures`,
vocabulary :data:`raysim.algorithm.MEASURES`)."""
from __future__ import annotations

from typing import Optional

from raysim.errors import ConfigError

MIXED_FLAG = "--mixed-metrics"


def _declared(name: str, params: Optional[dict]) -> dict:
    from raysim.config.registry import algorithm_class

    try:
        return algorithm_class(name).measures(params)
    except Exception:  # a method this process cannot load (a user's, not registered here): undeclared
        return {}


def describe(name: str, params: Optional[dict] = None) -> str:
    """A method's declared metrics and the model each evaluates, on one line: ``test_acc = the client's own model;
    test_acc_proto = nearest global prototype, among the client's own classes``; '' when it declares none."""
    from raysim.algorithm import MEASURES

    by_kind: dict = {}
    for m, k in _declared(name, params).items():
        by_kind.setdefault(k, []).append(m)
    return "; ".join(f"{', '.join(ms)} = {MEASURES.get(k, k)}" for k, ms in by_kind.items())


def kind_of(name: str, params: Optional[dict], metric: str) -> Optional[str]:
    """The kind of model ``metric`` evaluates for method ``name`` with ``params``; None where undeclared."""
    from raysim.algorithm import metric_kind

    return metric_kind(_declared(name, params), metric)


def kinds(configs: dict, metric: str) -> dict:
    """setting -> (method, kind or None) for ``metric``, from each setting's run config (``configs``: setting ->
    the config dict a run records)."""
    out = {}
    for setting, cfg in configs.items():
        algo = (cfg or {}).get("algorithm") or {}
        name = str(algo.get("name", "?"))
        out[setting] = (name, kind_of(name, algo.get("params") or {}, metric))
    return out


def mixed(configs: dict, metric: str) -> Optional[str]:
    """None when every setting compared declares one kind for ``metric`` (undeclared ones are not judged); else the
    phrase naming each kind and its settings (``the global model: fedavg; the client's own model: fedproto``)."""
    from raysim.algorithm import MEASURES

    by_kind: dict = {}
    for setting, (_, kind) in kinds(configs, metric).items():
        if kind is not None:
            by_kind.setdefault(kind, []).append(str(setting))
    if len(by_kind) <= 1:
        return None
    return "; ".join(f"{MEASURES.get(k, k)}: {', '.join(ss)}" for k, ss in by_kind.items())


def check(configs: dict, metrics, allow: bool, argument: str = "--metric") -> list[str]:
    """Refuse (one ConfigError naming ``argument``) to compare a metric whose kind differs across the methods of
    ``configs`` unless ``allow``; with ``allow``, the notes that say so (for the report's text)."""
    notes = []
    for metric in metrics:
        what = mixed(configs, metric)
        if what is None:
            continue
        if not allow:
            raise ConfigError(argument, f"{metric} evaluates different models across these settings ({what}); "
                                        f"compare a metric of one kind (raysim list says which model each method's "
                                        f"metrics evaluate, e.g. global_test_acc for the global model), or pass "
                                        f"{MIXED_FLAG} to compare them knowingly")
        notes.append(f"{metric} evaluates different models across these settings ({what}); compared as asked "
                     f"({MIXED_FLAG})")
    return notes


def run_configs(index, labels: dict) -> dict:
    """setting label -> the config of one of its runs (``index``: the run index with ``group`` and ``path``)."""
    from raysim.io import results

    out = {}
    for _, row in index.drop_duplicates("group").iterrows():
        out[labels.get(row["group"], row["group"])] = dict(results.load_metadata(row["path"]).get("config") or {})
    return out

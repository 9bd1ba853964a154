"""How ``raysim report`` names a setting: the user's name (``--label NAME=DIR``, else the config's ``label:``), or the
algorithm and the config keys whose *meaning* differs between the settings compared.

A key counts only where it acts on the run: ``server.*`` only on ``server.mode: async`` runs (and each rule's own
keys: ``buffer_size``/``server_lr`` for FedBuff, ``alpha`` for FedAsync), ``clients_per_round`` only on sync runs
(``all`` when unset), ``train.local_epochs`` only without
``train.local_steps``, ``model.arch``/``model.params`` only without ``model.per_client``, ``model.assign`` only with
it, ``model.tiers`` only with ``assign: tier``; a method's parameters only among runs of that method (compared with
the method's defaults filled in). An environment preset is expanded, so a key one setting sets and another takes from
the preset shows the preset's value, marked ``(preset)``; a key that one run's free-form mapping lacks
(``partition_params``, ``dataset_params``, ``model.params``) shows ``default``. Floats print with 4 significant
digits. Where and how fast a run computes (``backend`` but its identity keys ``vectorize``, ``numerics``,
``partial_aggregate``; ``output``, ``name``, ``seed``, recovery policies) never names a setting."""
from __future__ import annotations

import dataclasses
import json
from typing import Optional

NEVER = ("seed", "name", "label", "backend", "output", "on_actor_failure", "max_retries", "max_failed_share")
MISSING = object()


@dataclasses.dataclass(frozen=True)
class Shown:
    """A value as a label shows it."""
    value: object
    note: str = ""  # "preset" when an environment preset supplies it

    def text(self) -> str:
        v = self.value
        if v is MISSING:
            return "default"
        if isinstance(v, float):
            s = f"{v:.4g}"
            s = s if any(c in s for c in ".en") else s + ".0"  # still reads as a float: 1.0, not 1
        elif isinstance(v, (list, tuple)):
            s = "[" + ", ".join(Shown(x).text() for x in v) + "]"
        else:
            s = str(v)
        return f"{s} (preset)" if self.note else s

    def key(self) -> str:  # what "differs" compares: the value itself, not its provenance
        return "<missing>" if self.value is MISSING else json.dumps(self.value, sort_keys=True, default=str)


def _flat(d: dict, prefix: str = "", note: str = "", out: Optional[dict] = None) -> dict:
    out = {} if out is None else out
    for k, v in (d or {}).items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and "dist" not in v:  # a distribution {dist: ...} is one value
            _flat(v, key + ".", note, out)
        else:
            out[key] = Shown(v, note)
    return out


def _presets() -> dict:
    import importlib

    try:  # the environment layer (envs/) is reached by name: raysim never imports it directly
        return importlib.import_module("envs.presets").PRESETS
    except Exception:
        return {}


def _env(raw) -> dict:
    """The env section flattened with its preset expanded: keys the preset supplies are marked."""
    if not isinstance(raw, dict):
        return {}
    preset = _presets().get(raw.get("preset")) if raw.get("preset") else None
    out = _flat(preset or {}, "env.", "preset")
    out.update(_flat(raw, "env."))
    return out


def _method_params(algo: Optional[str], params) -> dict:
    """A method's parameters with its defaults filled in (as the run used them)."""
    full = dict(params or {})
    try:
        from raysim.config.registry import algorithm_class

        defaults = dataclasses.asdict(algorithm_class(algo).Params())
        full = {**json.loads(json.dumps(defaults, default=str)), **full}
    except Exception:  # an unknown method: its parameters as written
        pass
    return full


def meaningful(cfg: dict) -> dict:
    """{dotted key: Shown} of the keys that act on this run (see the module docstring)."""
    backend = (cfg or {}).get("backend") or {}
    cfg = {k: v for k, v in (cfg or {}).items() if k not in NEVER}
    algo = (cfg.get("algorithm") or {}).get("name")
    env, alg = cfg.pop("env", None), cfg.pop("algorithm", None) or {}
    out = _flat(cfg)
    for k in ("vectorize", "numerics", "partial_aggregate"):  # where not, but how exactly: part of the identity
        if k in backend:
            out[f"backend.{k}"] = Shown(backend[k])
    out["algorithm.name"] = Shown(algo)
    out.update(_flat(_method_params(algo, alg.get("params")), "algorithm.params."))
    out.update(_env(env))
    if env is None:  # no simulated environment: one key says so (its sub-keys compare only among runs that have one)
        out["env.preset"] = Shown("none")
    elif "env.preset" not in out or out["env.preset"].value is None:
        out["env.preset"] = Shown("custom")
    server = cfg.get("server") or {}
    drop = set()
    if server.get("mode", "sync") == "sync":  # server.mode itself stays: sync against async is a difference
        drop |= {k for k in out if k.startswith("server.") and k != "server.mode"}
        if out.get("clients_per_round", Shown(None)).value is None:
            out["clients_per_round"] = Shown("all")
    elif server.get("rule") == "fedasync":  # async: the clients in flight are server.concurrency
        drop |= {"server.buffer_size", "server.server_lr", "clients_per_round"}
    else:
        drop |= {"server.alpha", "clients_per_round"}
    train, model = cfg.get("train") or {}, cfg.get("model") or {}
    if train.get("local_steps") is not None:
        drop.add("train.local_epochs")
    if model.get("per_client"):
        drop |= {k for k in out if k.startswith(("model.arch", "model.params.", "model.embedding"))}
        drop.discard("model.per_client")
    else:
        drop |= {"model.assign", "model.tiers", "model.per_client"}
    if model.get("assign") != "tier":
        drop.add("model.tiers")
    return {k: v for k, v in out.items() if k not in drop}


def _short(key: str) -> str:
    return key.replace("algorithm.params.", "")


def auto_labels(cfgs: dict) -> dict:
    """group -> ``algorithm (key=value, ...)`` over the keys whose meaning differs between the groups."""
    flat = {g: meaningful(c) for g, c in cfgs.items()}
    keys = sorted({k for f in flat.values() for k in f} - {"algorithm.name"})

    def shown(f: dict, k: str) -> Shown:
        if k in f:
            return f[k]
        # absent: a free-form mapping's key (its loader's default), or a key with no meaning in this run
        return Shown(MISSING)

    def differs(k: str, algo) -> bool:
        peers = [f for f in flat.values() if not k.startswith("algorithm.params.") or
                 f["algorithm.name"].value == algo]
        having = [f for f in peers if k in f]
        return len(having) > 0 and len({shown(f, k).key() for f in (having if _relevance_key(k) else peers)}) > 1

    labels = {}
    for g, f in flat.items():
        algo = f["algorithm.name"].value
        parts = [f"{_short(k)}={f[k].text()}" for k in keys if k in f and differs(k, algo)]
        labels[g] = f"{algo or '?'}" + (f" ({', '.join(parts)})" if parts else "")
    return labels


def _relevance_key(k: str) -> bool:
    """Keys that exist only where they act (mode-dependent): compared only among the runs where they act, so a key
    absent for irrelevance is never shown as a difference."""
    return k.startswith(("server.", "train.local_epochs", "model.", "env.", "clients_per_round")) and k != "env.preset"

"""The maths of asynchronous aggregation (``server.mode: async``), as small pure functions.

* Staleness ``tau`` of an update: server versions applied between the client's dispatch and the update's arrival.
* Staleness functions (Xie et al., "Asynchronous Federated Optimization", 2019, section 5.2):
  ``constant`` s(tau) = 1; ``polynomial`` s(tau) = (1 + tau)^-a; ``hinge`` s(tau) = 1 if tau <= b else
  1 / (a (tau - b) + 1).
* **FedAsync** (Xie et al. 2019): each update is applied on arrival, x <- (1 - alpha_t) x + alpha_t x_new with
  alpha_t = alpha * s(tau).
* **FedBuff** (Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation", AISTATS 2022): the server
  waits for ``buffer_size`` updates; each is the client's delta against the server version it was dispatched with,
  Delta_i = y_i - x_{v_i}, and the server applies x <- x + eta_g * mean_i s(tau_i) * (weighted mean_i Delta_i)
  (s = constant by default: plain FedBuff; the method's aggregate gives the weights, FedAvg's sample counts).

Which state is "x" is the method's business: :meth:`raysim.algorithm.Asynchronous.async_aggregate` rebases each stale
FedBuff upload onto the current state (:meth:`~raysim.algorithm.Asynchronous.async_rebase`: y_i - x_{v_i} + x, for
methods whose uploads are trained copies of the state; prototypes are left as they are), computes the method's own
``aggregate`` of the uploads (the target, so target - x is the weighted mean of the deltas) and
:meth:`~raysim.algorithm.Asynchronous.async_mix` moves the server state toward it by the mixing weight computed here
(:func:`raysim.shared_maths.mix_trees` for plain trees of tensors). FedAsync's step is the paper's
x <- (1 - alpha_t) x + alpha_t y on the one arrived update.
"""
from __future__ import annotations

import math

STALENESS_FUNCTIONS = ("constant", "polynomial", "hinge")
RULES = ("fedbuff", "fedasync")


def staleness_weight(tau: int, fn: str = "constant", a: float = 0.5, b: int = 4) -> float:
    """s(tau) of Xie et al. 2019."""
    tau = int(tau)
    if tau < 0:
        raise ValueError(f"staleness must be >= 0, got {tau}")
    if fn == "constant":
        return 1.0
    if fn == "polynomial":
        return float((1.0 + tau) ** (-float(a)))
    if fn == "hinge":
        return 1.0 if tau <= b else 1.0 / (float(a) * (tau - b) + 1.0)
    raise ValueError(f"unknown staleness function {fn!r}; choose one of: {', '.join(STALENESS_FUNCTIONS)}")


def mixing_weight(rule: str, s: list[float], *, alpha: float = 0.6, server_lr: float = 1.0) -> float:
    """How far the server state moves toward the aggregate of the applied updates, from their staleness weights
    ``s`` = s(tau_i) (:func:`staleness_weight`): FedAsync alpha * s(tau) (one update), FedBuff server_lr * mean
    s(tau_i) over the buffer."""
    if not s:
        return 0.0
    if rule == "fedasync":
        if len(s) != 1:
            raise ValueError(f"FedAsync applies one update at a time, got {len(s)}")
        return float(alpha) * s[0]
    if rule == "fedbuff":
        return float(server_lr) * math.fsum(s) / len(s)
    raise ValueError(f"unknown rule {rule!r}; choose one of: {', '.join(RULES)}")


def check_async_method(cfg, algorithm_cls) -> None:
    """The method must opt into asynchronous aggregation (``raysim.algorithm.Asynchronous``: ``asynchronous`` and
    ``async_aggregate``; checked before any data is loaded)."""
    from raysim.errors import ConfigError

    if cfg.server.mode == "async" and not (getattr(algorithm_cls, "asynchronous", False)
                                           and callable(getattr(algorithm_cls, "async_aggregate", None))):
        raise ConfigError("server.mode", f"{cfg.algorithm.name} does not aggregate asynchronously (it does not "
                                         f"opt into raysim.algorithm.Asynchronous); use server.mode: sync, or fedavg, "
                                         f"fedprox, fedper, lgfedavg, fedproto, fedtgp")


def check_async(cfg, algorithm, env) -> None:
    """What ``server.mode: async`` needs beyond the config section's own checks (raysim.config.ServerConfig): a
    method that opts into ``raysim.algorithm.Asynchronous`` with the classic one-exchange round and no setup phase, and an
    environment that can time a single dispatch, without a round deadline. One ConfigError naming the key."""
    from raysim.errors import ConfigError
    from raysim.steps import CLASSIC_ROUND, flatten

    name = cfg.algorithm.name
    check_async_method(cfg, type(algorithm))
    steps = [(type(s).__name__, s.mode) for s, _ in flatten(algorithm.schedule())]
    if (steps != [(type(s).__name__, s.mode) for s, _ in flatten(CLASSIC_ROUND)]
            or algorithm.setup_schedule() is not None):
        raise ConfigError("server.mode", f"{name} with these parameters runs a multi-step round or a setup phase; "
                                         f"async needs one client update and one aggregation (use server.mode: sync)")
    if env is None or not all(callable(getattr(env, m, None)) for m in ("async_event", "async_available")):
        raise ConfigError("env", f"server.mode: async needs an environment that times single dispatches "
                                 f"(async_event, async_available: envs.Environment); {type(env).__name__} has none")
    # over-selection picks extra clients so that a round closes with K of them by its deadline; async has neither
    # rounds nor deadlines (server.concurrency clients are in flight): a preset's value is a round setting and is
    # ignored, one the config sets is refused
    over = ((cfg.env or {}).get("participation") or {}).get("over_selection") if isinstance(cfg.env, dict) else None
    if over is not None and over != 1:
        raise ConfigError("env.participation.over_selection", "selects extra clients for a round's deadline; "
                                                              "server.mode: async has no rounds (its clients in "
                                                              "flight are server.concurrency): remove it")
    _check_async_arrivals(getattr(getattr(env, "cfg", None), "participation", None))
    deadline = getattr(getattr(getattr(env, "cfg", None), "participation", None), "deadline_s", None)
    if deadline is not None:
        raise ConfigError("env.participation.deadline_s", "is a round deadline; server.mode: async has no rounds "
                                                          "(remove it, or bound staleness with server.max_staleness)")


def _check_async_arrivals(part) -> None:
    """An async server waits for arrivals: with every client dropping out (dropout 1) or never available
    (availability p 0, or a diurnal high of 0) none ever comes, and the event loop would spin forever (issue 50)."""
    from raysim.errors import ConfigError

    if part is None:
        return
    if getattr(part, "dropout", 0.0) >= 1.0:
        raise ConfigError("env.participation.dropout", "is 1: every dispatched client drops out, so no update ever "
                                                       "arrives and server.mode: async would wait forever; use a "
                                                       "dropout below 1")
    a = getattr(part, "availability", None)
    never = a is not None and ((a.mode == "bernoulli" and a.p <= 0.0) or (a.mode == "diurnal" and a.high <= 0.0))
    if never:
        key = "p" if a.mode == "bernoulli" else "high"
        raise ConfigError(f"env.participation.availability.{key}", "is 0: no client is ever available, so "
                                                                   "server.mode: async would wait forever")

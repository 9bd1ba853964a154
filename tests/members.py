"""Test helper: the members of a vectorised group (raysim.runner.vectorized.Member) from parallel lists, one per
client (the executor builds its own members; only tests zip lists)."""
from raysim.runner.vectorized import Member


def zip_members(params, xs, ys, batches, dropouts, opt_states=None) -> list[Member]:
    return [Member(p, x, y, b, d, o) for p, x, y, b, d, o in
            zip(params, xs, ys, batches, dropouts, opt_states or [None] * len(params))]

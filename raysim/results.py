"""``import raysim.results``: the module :mod:`raysim.io.results` under its historical name (the same module object;
kept out of ``import raysim`` so that processes that never read a table, such as Ray workers, do not load pandas)."""
import sys

from raysim.io import results

sys.modules[__name__] = results

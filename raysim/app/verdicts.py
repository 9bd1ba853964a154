"""``raysim.app.verdicts``: the module :mod:`raysim.verdicts` under its earlier name (the same module object). The
verdicts' maths moved below the application (issue 52) so that ``raysim.results.paired`` -- the comparison of one's
own runs -- uses the very code of ``raysim reproduce``'s claims, and nothing below the application imports it."""
import sys

from raysim import verdicts

sys.modules[__name__] = verdicts

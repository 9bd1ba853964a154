"""Static check of the shipped code with pyflakes (the test extra installs it): no unused imports or variables, no
undefined names, no redefinitions, in the packages, the tests, the benchmarks and the scripts."""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ["raysim", "algorithms", "envs", "tuning", "tests", "benchmarks", "scripts"]


def test_pyflakes_finds_nothing():
    from pyflakes.api import checkPath
    from pyflakes.reporter import Reporter

    class Collect(Reporter):
        def __init__(self):
            self.found: list[str] = []

        def unexpectedError(self, filename, msg):
            self.found.append(f"{filename}: {msg}")

        def syntaxError(self, filename, msg, lineno, offset, text):
            self.found.append(f"{filename}:{lineno}: {msg}")

        def flake(self, message):
            self.found.append(str(message))

    rep = Collect()
    files = sorted(p for d in CHECKED for p in (ROOT / d).rglob("*.py"))
    assert len(files) > 50
    for p in files:
        checkPath(str(p), rep)
    assert not rep.found, "pyflakes:\n" + "\n".join(rep.found)


def test_every_late_ray_test_exists():
    """tests/conftest.py orders the Ray-session tests by the names in RAY_LATE: a renamed test would silently lose
    its place (and the suite its warm actors)."""
    import re

    from tests.conftest import RAY_LATE

    defined = {m for p in (ROOT / "tests").glob("test_*.py") for m in re.findall(r"^def (test_\w+)\(", p.read_text(), re.M)}
    assert set(RAY_LATE) <= defined, sorted(set(RAY_LATE) - defined)

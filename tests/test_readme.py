"""The README's snippets that users copy run as written."""
import re
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent


def readme_block(section: str, contains: str) -> str:
    """The first ```python block of the README section ``section`` (a ``## `` heading) that holds ``contains``."""
    text = (ROOT / "README.md").read_text()
    part = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    blocks = [b for b in re.findall(r"```python\n(.*?)```", part, re.S) if contains in b]
    assert blocks, f"README section {section!r} has no python block with {contains!r}"
    return blocks[0]


def test_writing_a_method_snippet_runs_the_checks_on_a_registered_method(monkeypatch):
    """The snippet, run from examples/byo/ as the README says: it registers examples/byo/mymethod.py's UniformAvg and
    passes every sequential check; the registration is undone after the test."""
    from raysim.config import registry

    code = readme_block("Writing a method", "from raysim import testing")
    assert "register_algorithm" in code and "check_algorithm(cfg)" in code
    monkeypatch.chdir(ROOT / "examples" / "byo")
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "byo"))
    monkeypatch.delitem(sys.modules, "mymethod", raising=False)
    for table in (registry.ALGORITHMS, registry.USER_ALGORITHMS):  # undone after the test
        monkeypatch.setitem(table, "uniform_avg", "placeholder")
    before = set(registry.ALGORITHMS)
    scope: dict = {}
    exec(compile(code, "README.md (Writing a method)", "exec"), scope)
    assert set(registry.ALGORITHMS) == before  # the snippet registers nothing the fixture does not undo
    assert registry.ALGORITHMS["uniform_avg"] == "mymethod:UniformAvg"
    table = scope["table"]
    assert isinstance(table, pd.DataFrame) and (table["metric"] == "clients_averaged").any()  # UniformAvg ran
    assert scope["cfg"].backend.name == "sequential"

"""The code version every run records (raysim/engine/provenance.py; run metadata versions.code)."""
from __future__ import annotations

from raysim.engine import provenance as pv


def _tree(root, text="x = 1\n"):
    pkg = root / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "mod.py").write_text(text)
    return [("pkg", pkg)]


def test_the_source_digest_follows_the_source_and_nothing_else(tmp_path):
    a = _tree(tmp_path / "a")
    b = _tree(tmp_path / "b")
    assert pv.source_digest(a) == pv.source_digest(b)  # the same bytes anywhere: the same code
    (tmp_path / "b" / "pkg" / "__pycache__").mkdir()
    (tmp_path / "b" / "pkg" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"\0\1")
    assert pv.source_digest(a) == pv.source_digest(b)  # bytecode is not source
    (tmp_path / "b" / "pkg" / "sub" / "mod.py").write_text("x = 2\n")
    assert pv.source_digest(a) != pv.source_digest(b)
    (tmp_path / "b" / "pkg" / "sub" / "mod.py").write_text("x = 1\n")
    (tmp_path / "b" / "pkg" / "sub" / "new.py").write_text("")
    assert pv.source_digest(a) != pv.source_digest(b)  # a new file is a change too


def test_outside_a_git_checkout_there_is_no_commit(tmp_path):
    assert pv.git_state(_tree(tmp_path)) == (None, None)


def test_this_process_code_version_and_its_comparison():
    here = pv.code_version()
    from raysim import __version__

    assert here["raysim"] == __version__ and len(here["source"]) == 16
    assert pv.same(here, dict(here)) and pv.same(here, dict(here, commit="another", dirty=True))  # commit: provenance
    assert not pv.same(here, dict(here, source="0" * 16)) and not pv.same(here, dict(here, raysim="9.9"))
    assert not pv.same(None, here) and not pv.same(here, {}) and not pv.same(None, None)
    assert pv.label(None).startswith("not recorded")
    assert pv.label({"raysim": "0.1.0", "source": "ab", "commit": "c" * 40, "dirty": True}) == \
        "raysim 0.1.0 source ab (commit cccccccccccc, uncommitted changes)"
    from raysim.engine.prepare import versions

    assert versions()["code"] == here  # what every run's metadata records (versions.code)

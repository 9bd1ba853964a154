"""Every ``raysim ...`` command line of README.md runs as written, in a dry-run or tiny form (issue 52: the README's
tune example failed for want of ``data.val_fraction``).

Each line is taken from the README's shell blocks (continuations joined, comments dropped) and run through
``raysim.app.cli.main`` in a scratch directory that sees the checkout's ``configs/``:

* ``run``: with ``--dry-run`` (config, data, models checked; nothing trained or written) the first time a config file
  on a quick built-in dataset appears; otherwise (the same file again, or Fashion-MNIST: seconds to decode) the
  config layer with the line's overrides and its env section;
* ``tune``: its base config, search space and objective checked exactly as the study starts them
  (``tuning.study._study_space``); ``tune --show STORAGE``: on a study with one finished trial made in that storage;
* ``report``: on small made-up runs written where the line looks for them (``--no-plots``: plots are
  tests/test_report*.py's);
* ``reproduce EXP``: planned and its (empty) table written (``--report-only --no-report``); ``runs DIR``: on an empty
  DIR; ``list``, ``reproduce --list`` and ``tune --show``: as written.

Lines with a placeholder (``CONFIG``, ``<run dir>``) are skipped, and counted."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from raysim.app.cli import main
from raysim.io.results import RESULTS_FILE, ResultTable, write_parquet
from tests.conftest import tiny_config

ROOT = Path(__file__).resolve().parents[1]
QUICK_DATASETS = {"mnist5k", "synthetic", "digits"}


def _blocks(text: str):
    lang = None
    buf: list[str] = []
    for line in text.splitlines():
        if line.startswith("```"):
            if lang is None:
                lang, buf = line[3:].strip() or "text", []
            else:
                yield lang, "\n".join(buf)
                lang = None
        elif lang is not None:
            buf.append(line)


def readme_commands() -> list[list[str]]:
    out = []
    for lang, block in _blocks((ROOT / "README.md").read_text()):
        if lang not in ("bash", "sh", "console", "text"):
            continue
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            for seg in line.split("&&"):
                seg = seg.strip()
                if seg.startswith("raysim "):
                    out.append(shlex.split(seg, comments=True)[1:])
    return out


def _fake_runs(parent: Path, seeds=(1, 2, 3), rounds: int = 2, lam=None) -> None:
    for seed in seeds:
        t = ResultTable(f"fp-s{seed}")
        for rnd in range(rounds):
            t.add(rnd, -1, "total", "up_bytes", 100)
            t.add(rnd, -1, "total", "down_bytes", 100)
            for cid in range(2):
                t.add(rnd, cid, "client", "test_acc", 0.5 + 0.2 * rnd + 0.01 * seed)
                t.add(rnd, cid, "client", "test_acc_proto", 0.6 + 0.2 * rnd)
        d = parent / f"seed{seed}"
        d.mkdir(parents=True)
        config = {**tiny_config(), "seed": seed}
        if lam is not None:  # another setting of the same method
            config["algorithm"] = {**config["algorithm"], "params": {**config["algorithm"].get("params", {}), "lam": lam}}
        write_parquet(t.frame(), d / RESULTS_FILE, {"run_id": f"fp-s{seed}", "seed": seed, "config": config})


def _option(argv, name):
    return argv[argv.index(name) + 1] if name in argv else None


def _run(argv, dry_run_done: set):
    """A dry run the first time a config file appears (data, split, models checked); the config layer after that
    (every key and override checked, the method switch and its notice, the env section)."""
    from raysim.config import load_config, load_config_dict

    config = argv[1]
    overrides = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"] + (
        [f"backend.name={_option(argv, '--backend')}"] if "--backend" in argv else [])
    cfg = load_config(config, overrides)
    if cfg.data.dataset in QUICK_DATASETS and config not in dry_run_done:
        dry_run_done.add(config)
        return main(argv + ([] if "--dry-run" in argv else ["--dry-run"]))
    load_config_dict(config)
    if cfg.env is not None:
        from envs.config import parse_env

        parse_env(cfg.env)
    return 0


def _tune(argv, tmp_path):
    """A study line: its base config, space and objective checked as the study starts them; ``--show``: on a study
    made in that storage (one finished trial of the search space, no training)."""
    if "--show" in argv:
        import optuna

        from tuning.storage import open_storage

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(study_name="readme", storage=open_storage(_option(argv, "--show")),
                                    direction="maximize")
        study.set_user_attr("space", {"objective": {"metric": "val_acc", "mode": "final"}})
        study.add_trial(optuna.trial.create_trial(params={"algorithm.params.lam": 0.5}, value=0.9, distributions={
            "algorithm.params.lam": optuna.distributions.FloatDistribution(0.01, 50.0, log=True)}))
        return main(argv)
    from tuning.space import load_space
    from tuning.study import _study_space

    overrides = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    _study_space(argv[1], load_space(_option(argv, "--space")), overrides, lambda *a: None)  # as written
    return 0


def test_every_readme_command_line_runs(tmp_path, monkeypatch, capsys):
    commands = readme_commands()
    assert len(commands) >= 12 and any(c[:1] == ["tune"] for c in commands)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    skipped, dry_runs = [], set()
    for argv in commands:
        if any(a == "CONFIG" or "<" in a for a in argv):
            skipped.append(argv)
            continue
        if argv[0] == "run":
            code = _run(argv, dry_runs)
        elif argv[0] == "tune":
            code = _tune(argv, tmp_path)
        elif argv[0] == "report":
            _fake_runs(tmp_path / argv[1])
            code = main(argv + ["--no-plots"])  # the plots: tests/test_report*.py
        elif argv[0] == "compare":  # after the runs it names: five seeds of six rounds each
            dirs = [a for a in argv[1:] if not a.startswith("-") and "runs/" in a and "=" not in a]
            for i, d in enumerate(dirs):
                _fake_runs(tmp_path / d, seeds=(1, 2, 3, 4, 5), rounds=6, lam=1.0 / (i + 1))
            code = main(argv)
        elif argv[0] == "runs":  # after a run: the directory exists
            (tmp_path / argv[1]).mkdir(parents=True, exist_ok=True)
            code = main(argv)
        elif argv[0] == "reproduce" and "--list" not in argv:
            code = main(argv + ["--report-only", "--no-report"])
        else:
            code = main(argv)
        err = capsys.readouterr().err
        assert code == 0, f"README: raysim {' '.join(argv)} -> exit {code}: {err[-2000:]}"
    assert [a[0] for a in skipped] == ["run"]  # only `raysim run CONFIG --resume <run dir>.incomplete`
    assert (tmp_path / "report" / "summary.md").exists()
    assert "| FedProto | 3 | 1,2,3 |" in (tmp_path / "report" / "summary.md").read_text()


@pytest.mark.parametrize("line", ["raysim tune configs/fedproto_mnist5k.yaml --space configs/tune_fedproto_lam.yaml "
                                  "--trials 20 --storage sqlite:///runs/lam.db --set rounds=30"])
def test_the_old_tune_line_would_have_failed(line, tmp_path, monkeypatch):
    """The check above can fail: the README's old tune line (without data.val_fraction) is refused by it."""
    from raysim.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    with pytest.raises(ConfigError, match="val_fraction"):
        _tune(shlex.split(line)[1:], tmp_path)

"""Switching method by --set or a sweep (issue 52, item 2): shared parameters are kept only with a notice naming each
kept value beside the new method's default; ``algorithm.reset_params=true`` takes the new method's defaults."""
from pathlib import Path

import pytest

from raysim.config import make_config
from raysim.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
FEDPROTO = {"name": "p", "algorithm": {"name": "fedproto", "params": {"lam": 1.0, "proto_agg": "mean"}}}


def test_kept_value_is_named_beside_the_new_method_s_default():
    notes = []
    cfg = make_config(FEDPROTO, ["algorithm.name=fedtgp"], notes.append)
    assert cfg.algorithm.name == "fedtgp" and cfg.algorithm.params == {"lam": 1.0, "proto_agg": "mean"}
    assert len(notes) == 1
    assert notes[0] == ("algorithm.name changed from fedproto to fedtgp: kept lam=1.0; fedtgp's default is 10.0; "
                        "kept proto_agg=mean; fedtgp's default is weighted; --set algorithm.reset_params=true takes "
                        "fedtgp's defaults instead")


def test_reset_params_takes_the_new_method_s_defaults_but_keeps_what_the_user_sets():
    notes = []
    cfg = make_config(FEDPROTO, ["algorithm.name=fedtgp", "algorithm.reset_params=true",
                                 "algorithm.params.margin_threshold=50"], notes.append)
    assert cfg.algorithm.params == {"margin_threshold": 50}
    assert "reset_params" not in cfg.algorithm.params and notes == [
        "algorithm.name changed from fedproto to fedtgp: algorithm.reset_params=true, so fedtgp runs with its own "
        "defaults; not carried over: lam=1.0, proto_agg=mean"]
    # the directive is no part of the config: the same run id as the defaults written out
    assert cfg.run_id() == make_config({"name": "p", "algorithm": {"name": "fedtgp", "params": {
        "margin_threshold": 50}}}).run_id()


def test_a_value_equal_to_the_new_default_says_so_and_no_switch_no_notice():
    notes = []
    make_config({"name": "p", "algorithm": {"name": "fedproto", "params": {"lam": 10.0}}},
                ["algorithm.name=fedtgp"], notes.append)
    assert notes == ["algorithm.name changed from fedproto to fedtgp: kept lam=10.0; fedtgp's default too"]
    notes.clear()
    make_config(FEDPROTO, ["algorithm.params.lam=2"], notes.append)
    assert notes == []
    make_config(FEDPROTO, ["algorithm.reset_params=true"], notes.append)
    assert notes == ["algorithm.reset_params=true does nothing: algorithm.name is unchanged (fedproto)"]


def test_reset_params_must_be_a_boolean():
    with pytest.raises(ConfigError, match=r"algorithm\.reset_params.*true or false"):
        make_config(FEDPROTO, ["algorithm.name=fedtgp", "algorithm.reset_params=yes please"])


def test_a_sweep_over_algorithm_name_reconciles_too(capsys):
    from tuning.space import apply_params

    cfg = apply_params(FEDPROTO, {"algorithm.name": "fedavg"})
    assert cfg.algorithm.params == {}  # fedavg has neither lam nor proto_agg
    cfg = apply_params(FEDPROTO, {"algorithm.name": "fedtgp"})
    assert cfg.algorithm.params == {"lam": 1.0, "proto_agg": "mean"}
    assert "kept lam=1.0; fedtgp's default is 10.0" in capsys.readouterr().err


def test_the_dry_run_shows_the_notice(tmp_path, capsys):
    import yaml

    from raysim.app.cli import main
    from tests.conftest import tiny_config

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(algorithm={"name": "fedproto", "params": {"lam": 1.0,
                                                                                      "proto_agg": "mean"}})))
    rc = main(["run", str(cfg), "--set", "algorithm.name=fedtgp", "--set", "algorithm.params.lam=1.0", "--dry-run"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    line = [ln for ln in out.splitlines() if ln.startswith("# note: algorithm.name changed")]
    assert len(line) == 1 and "kept proto_agg=mean; fedtgp's default is weighted" in line[0]
    assert "lam" not in line[0]  # set on the command line: the user's choice, not carried over
    assert "kept proto_agg=mean" in err

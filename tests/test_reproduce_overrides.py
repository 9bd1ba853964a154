"""What was run is what the table says (issue 52, item 1): a reproduction's overrides are in its scale line, its JSON
and its header; the seed's number is compared value for value (diff) only at the seed's dataset, model and protocol,
otherwise it is shown for the direction only."""
import pytest

from raysim.app import seed_experiments as rp
from raysim.app.reproduction_table import render_records, scale_text, seed_compared, summarise, table_markdown
from raysim.errors import ConfigError
from tests.test_verdicts import PER_RUN, _experiment, _per_run


def _md(exp, numbers, overrides=()):
    per_run = _per_run(PER_RUN)
    table, claims = summarise(exp, per_run, numbers)
    return table_markdown(rp.replace(exp, cli_overrides=tuple(overrides)), table, claims, numbers, per_run)


def test_at_the_seed_s_setting_the_diff_is_the_difference(tmp_path):
    exp, numbers = _experiment(tmp_path)  # scaled "" and no overrides: the seed's setting
    assert exp.matches_seed and seed_compared(exp)
    md = _md(exp, numbers)
    assert "| A | 3 | 81.00 ± 1.00 | 70.00 | +11.00 |" in md and "direction only" not in md
    assert "with overrides" not in md and "Scale: the seed’s full size." in md
    # backend / output / data.root change where the runs compute, not what: still compared, but recorded
    md = _md(exp, numbers, ["backend.name=ray", "data.root=/data"])
    assert "| A | 3 | 81.00 ± 1.00 | 70.00 | +11.00 |" in md
    assert "with overrides in every run: --set backend.name=ray, --set data.root=/data" in md


def test_an_override_of_the_protocol_is_labelled_and_gives_the_direction_only(tmp_path):
    exp, numbers = _experiment(tmp_path)
    md = _md(exp, numbers, ["rounds=10"])
    head = md.splitlines()[0]
    assert head == "## toy: toy — with overrides: rounds=10 (not the manifest's setting)"
    assert "Scale: the seed’s full size; with overrides in every run: --set rounds=10." in md
    assert "| A | 3 | 81.00 ± 1.00 | 70.00 | direction only |" in md
    assert "| C | 3 | 79.00 ± 0.00 | – | – |" in md  # no seed number: nothing to compare
    assert "the overrides change the protocol (rounds=10)" in md
    assert scale_text(exp, ["rounds=10"]) == "the seed’s full size; with overrides in every run: --set rounds=10"


def test_a_scaled_experiment_or_one_marked_off_the_seed_s_setting_gives_the_direction_only(tmp_path):
    exp, numbers = _experiment(tmp_path)
    scaled = rp.replace(exp, scaled="mnist5k for MNIST")
    assert not scaled.matches_seed
    md = _md(scaled, numbers)
    assert "| A | 3 | 81.00 ± 1.00 | 70.00 | direction only |" in md
    assert "this experiment's dataset, model or protocol is not the seed's" in md
    assert not rp.replace(exp, seed_setting=False).matches_seed  # e.g. a stand-in model at full size
    assert rp.replace(scaled, seed_setting=True).matches_seed


def test_the_json_records_the_overrides(tmp_path):
    exp, numbers = _experiment(tmp_path)
    record = {"experiment": "toy", "runs": _per_run(PER_RUN).to_dict("records"), "overrides": ["rounds=10"]}
    md, new = render_records(exp, record, numbers)
    assert new["overrides"] == ["rounds=10"] and new["with_overrides"] is True and new["seed_compared"] is False
    assert new["scaled"] == "the seed’s full size; with overrides in every run: --set rounds=10"
    _, plain = render_records(exp, {"runs": record["runs"]}, numbers)
    assert plain["overrides"] == [] and plain["seed_compared"] is True


def test_seed_setting_must_be_a_boolean(tmp_path):
    import yaml

    exp, _ = _experiment(tmp_path)
    path = tmp_path / "configs" / "seed999_toy" / "experiments.yaml"
    body = yaml.safe_load(path.read_text())
    body["toy"]["seed_setting"] = "yes"
    path.write_text(yaml.safe_dump(body))
    with pytest.raises(ConfigError, match="seed_setting"):
        rp.load_experiments(tmp_path / "configs")


def test_the_shipped_stand_in_at_full_size_is_not_compared_value_for_value():
    exps = rp.load_experiments()
    assert not exps["slaugfl_cifar10_a005"].matches_seed  # resnet_small for ResNet18
    assert not exps["seed002_fmnist_zoo"].matches_seed  # Fashion-MNIST for CIFAR-10 (the issue's +10.16)


def test_raysim_reproduce_with_set_records_it_everywhere(tmp_path, capsys):
    """The issue's case end to end: ``--set rounds=1`` on a 2-round manifest is in the header, the scale line, the
    JSON (``scaled``, ``overrides``) and every run's config."""
    import json

    from raysim.app.cli import main
    from tests.test_reproduce import _write_root

    root = _write_root(tmp_path)
    out = tmp_path / "out"
    assert main(["reproduce", "toy_table", "--configs", str(root), "--out", str(out), "--no-report", "--seeds", "1",
                 "--set", "rounds=1"]) == 0
    md = (out / "toy_table" / "reproduction.md").read_text()
    js = json.loads((out / "toy_table" / "reproduction.json").read_text())
    assert md.splitlines()[0] == "## toy_table: toy — with overrides: rounds=1 (not the manifest's setting)"
    assert "Scale: toy size; with overrides in every run: --set rounds=1." in md
    assert js["overrides"] == ["rounds=1"] and js["scaled"] == "toy size; with overrides in every run: --set rounds=1"
    assert js["with_overrides"] is True and js["seed_compared"] is False
    assert "direction only" in md
    from raysim.io.results import load_metadata

    assert load_metadata(out / "toy_table" / "local" / "seed1")["config"]["rounds"] == 1

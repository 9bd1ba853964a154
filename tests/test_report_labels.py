"""Readable reports (issue 52): setting names from keys that differ in meaning, --label NAME=DIR and the config's
label:, legends outside the axes (the plots' one file-name pattern: tests/test_report.py), rounds counted as rounds
completed, results.final's scalar form."""
from __future__ import annotations

import pandas as pd
import pytest

from raysim.app.cli import main
from raysim.app.labels import auto_labels
from raysim.config import make_config, to_dict
from raysim.io import results
from raysim.io.results import ResultTable, write_parquet
from tests.conftest import tiny_config


def full(**over) -> dict:
    return to_dict(make_config(tiny_config(**over)))


def write_run(root, name, seed, cfg, accs=((0.5, 0.7), (0.8, 0.9))):
    run_id = f"{name}-s{seed}"
    t = ResultTable(run_id)
    for rnd, pair in enumerate(accs):
        t.add(rnd, -1, "total", "up_bytes", 100)
        t.add(rnd, -1, "total", "down_bytes", 200)
        for cid, a in enumerate(pair):
            t.add(rnd, cid, "client", "test_acc", a + 0.01 * seed)
    d = root / name / f"seed{seed}"
    d.mkdir(parents=True)
    write_parquet(t.frame(), d / results.RESULTS_FILE, {"run_id": run_id, "config": {**cfg, "seed": seed},
                                                         "seed": seed})
    return d


ENV = {"preset": "mobile-heterogeneous", "participation": {"dropout": 0.2}}


def test_labels_name_only_keys_that_act_on_the_run():
    sync = full(clients_per_round=4)  # sync rounds: server.* (buffer_size, ...) act on nothing
    fedbuff = full(server={"mode": "async", "buffer_size": 3, "concurrency": 6}, env={"preset": "uniform"})
    fedbuff5 = full(server={"mode": "async", "buffer_size": 5, "concurrency": 6}, env={"preset": "uniform"})
    labels = auto_labels({"s": sync, "b3": fedbuff, "b5": fedbuff5})
    assert labels["s"] == "fedproto (env.preset=none, server.mode=sync)"  # clients_per_round: only sync runs have it
    assert labels["b3"] == "fedproto (env.preset=uniform, server.buffer_size=3, server.mode=async)"
    assert "alpha" not in labels["b5"] and "server_lr" not in labels["b5"]  # FedAsync's key, FedBuff's unchanged
    two_sync = auto_labels({"s4": sync, "all": full(), "b3": fedbuff})
    assert two_sync["s4"].startswith("fedproto (clients_per_round=4, ") and "clients_per_round=all" in two_sync["all"]
    assert "clients_per_round" not in two_sync["b3"]


def test_labels_show_preset_values_as_the_presets_method_defaults_and_4_digit_floats():
    a = full(env=ENV, train={"lr": 0.0123456})
    b = full(env={"preset": "mobile-heterogeneous"}, train={"lr": 0.05})
    labels = auto_labels({"a": a, "b": b})
    assert labels["a"] == "fedproto (env.participation.dropout=0.2, train.lr=0.01235)"
    assert labels["b"] == "fedproto (env.participation.dropout=0.05 (preset), train.lr=0.05)"
    # a method's parameter compared with the method's default filled in: lam=1.0 written or not is one setting
    c = full(algorithm={"name": "fedproto", "params": {}})
    d = full(algorithm={"name": "fedproto", "params": {"lam": 2.0}})
    e = full(algorithm={"name": "fedavg", "params": {}})
    labels = auto_labels({"c": c, "d": d, "e": e})
    assert labels == {"c": "fedproto (lam=1.0)", "d": "fedproto (lam=2.0)", "e": "fedavg"}
    vec = auto_labels({"c": c, "v": full(backend={"name": "ray", "vectorize": True, "num_actors": 4})})
    assert vec == {"c": "fedproto (backend.vectorize=auto)", "v": "fedproto (backend.vectorize=True)"}
    same = auto_labels({"c": c, "x": full(algorithm={"name": "fedproto", "params": {"lam": 1.0}})})
    assert same == {"c": "fedproto", "x": "fedproto"}  # (report.setting_labels then keeps them apart)


def test_label_option_and_config_label_name_settings(tmp_path, capsys):
    a = [write_run(tmp_path / "runs", "a", s, full(name="a")) for s in (1, 2)]
    write_run(tmp_path / "runs", "b", 1, full(name="b", label="my baseline", train={"lr": 0.1}))
    out = tmp_path / "rep"
    assert main(["report", str(tmp_path / "runs"), "--out", str(out), "--no-plots",
                 "--label", f"FedProto tuned={a[0].parent}"]) == 0
    md = (out / "summary.md").read_text()
    assert "| FedProto tuned | 2 | 1,2 |" in md and "| my baseline | 1 | 1 |" in md
    capsys.readouterr()
    # a --label naming a directory without a run of this report, or no directory: one line naming --label, exit 2
    (tmp_path / "empty").mkdir()
    for bad in (f"x={tmp_path / 'empty'}", f"x={tmp_path / 'missing'}", "no-equals-sign"):
        assert main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "rep2"), "--label", bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--label" in err[0]
        assert not (tmp_path / "rep2").exists()
    # a directory holding two settings cannot take one name
    assert main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "rep3"), "--label",
                 f"x={tmp_path / 'runs'}"]) == 2
    assert "2 settings" in capsys.readouterr().err
    # --label alone reads its DIR (as compare does); a NAME may hold '='; a run named twice is read once
    assert main(["report", str(a[0].parent), "--out", str(tmp_path / "rep4"), "--no-plots",
                 "--label", f"lr=0.05={a[0].parent}", "--label", f"lr=0.1={tmp_path / 'runs' / 'b'}"]) == 0
    md = (tmp_path / "rep4" / "summary.md").read_text()
    assert "| lr=0.05 | 2 | 1,2 |" in md and "| lr=0.1 | 1 | 1 |" in md


@pytest.mark.parametrize("labels", [["fedproto (lam=1.0) (n=2)", "fedavg (n=2)"],
                                    ["fedproto (lam=1.0, train.lr=0.05, train.momentum=0.9, data.val_fraction=0.1)",
                                     "fedavg (train.lr=0.1, train.momentum=0.5, data.val_fraction=0.2) (n=3)"]])
def test_legend_never_overlaps_the_axes_or_their_labels(labels):
    from raysim.app.summary import _legend, _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for i, label in enumerate(labels):
        ax.plot([1, 2, 3], [0.2 + i, 0.5, 0.9], label=label)
    ax.set_xlabel("simulated time (sim_round_s, cumulative)")
    ax.set_ylabel("mean client test_acc")
    fig.tight_layout()
    _legend(fig, ax, "mean over seeds")
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    legend = ax.get_legend().get_window_extent(r)
    axes_box = ax.get_tightbbox(r, bbox_extra_artists=[])  # the axes with ticks, tick labels and axis labels
    assert not legend.overlaps(axes_box)
    plt.close(fig)


def test_final_has_a_scalar_form_and_counts_rounds_completed():
    t = ResultTable("r")
    for rnd, accs in ((0, (0.6, 0.8)), (1, (0.5, 0.5))):
        for cid, a in enumerate(accs):
            t.add(rnd, cid, "client", "test_acc", a)
    df = t.frame()
    assert results.final(df, "test_acc", scalar=True) == pytest.approx(0.5)
    assert results.best(df, scalar=True) == pytest.approx(0.7)
    fin = results.final(df)
    assert fin["round"].iloc[0] == 1 and fin["rounds"].iloc[0] == 2  # 0-based index; rounds completed
    two = __import__("pandas").concat([df, df.assign(run_id="q")])
    with pytest.raises(ValueError, match="needs one run"):
        results.final(two, scalar=True)
    assert results.final(two, run_id="q", scalar=True) == pytest.approx(0.5)


def test_log_axis_tick_labels_do_not_run_into_each_other():
    """The bytes axis over 1.2 decades: matplotlib's default labelled 3x10^5 and 4x10^5 side by side, touching."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from raysim.app.summary import log_ticks
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    ax.plot([4.7e4, 1.2e5, 3.6e5, 5.2e5, 7.0e5], [0.3, 0.4, 0.5, 0.6, 0.7])
    ax.set_xscale("log")
    log_ticks(ax.xaxis)
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    shown = [t for t in ax.get_xticklabels() + ax.xaxis.get_minorticklabels() if t.get_text() and t.get_visible()]
    xmin, xmax = ax.get_xlim()
    shown = [t for t in shown if xmin <= t.get_position()[0] <= xmax]
    boxes = sorted((t.get_window_extent(r) for t in shown), key=lambda b: b.x0)
    plt.close(fig)
    assert len(boxes) >= 3 and [t.get_text() for t in shown][:1] != [""]
    assert all(a.x1 < b.x0 for a, b in zip(boxes, boxes[1:]))


def test_reproduce_names_report_settings_by_method_so_identical_configs_stay_apart(tmp_path):
    """Two methods of a manifest with one config (seed001's 'PN-ICFL' and 'PN-ICFL seed init') were one setting of
    10 runs with every seed twice; the report of a reproduction names its settings by the table's methods."""
    from raysim.app.summary import ReportOptions, build_report
    from raysim.app.reproduction_table import method_labels
    runs = [write_run(tmp_path / m, "x", s, full(name="x")) for m in ("m1", "m2") for s in (1, 2)]
    per_run = pd.DataFrame({"label": ["A", "A", "B", "B"], "path": [str(r) for r in runs]})
    assert method_labels(per_run) == {"A": str(tmp_path / "m1" / "x"), "B": str(tmp_path / "m2" / "x")}
    build_report([str(r) for r in runs], tmp_path / "rep", ReportOptions(plots=False, labels=method_labels(per_run)))
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert "| A | 2 | 1,2 |" in md and "| B | 2 | 1,2 |" in md

"""Looking at a study, and whether it could rank its trials (``raysim tune --show DIR|STORAGE``, issue 52).

:func:`show` prints a study as it stands in its storage: the objective, the best trial (value, parameters, run
directory), every trial sorted by value (best first; failed and pruned ones last) and Optuna's parameter importances
(``optuna.importance.get_param_importances`` with Optuna's default evaluator, over the finished trials).

:func:`validation_warnings`: a validation objective ranks trials only when it can tell them apart. A client's
``val_acc`` moves in steps of 1/n for n validation samples, so with a few dozen samples per client nearby settings
tie exactly (issue 52 found trials tied with 13-20 images per client). Below ``MIN_VAL_PER_CLIENT`` samples per
client (the median over clients, from the trials' run metadata), or when the best value is shared by several
trials, a warning says so and how to enlarge the split."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd

from raysim.errors import ConfigError

MIN_VAL_PER_CLIENT = 50


def _val_sizes(run_dir) -> Optional[list]:
    if not run_dir:
        return None
    try:
        from raysim.io import results

        return (results.load_metadata(run_dir).get("data") or {}).get("val_sizes")
    except Exception:  # a trial's directory moved or damaged: no size to judge by
        return None


def validation_warnings(trials: pd.DataFrame, metric: str, val_fraction: float) -> list[str]:
    """Warnings (text) when the validation split is too small to rank the study's trials."""
    out = []
    done = trials[trials["state"] == "COMPLETE"] if len(trials) else trials
    how = (f"enlarge it: a larger data.val_fraction (now {val_fraction:g}; e.g. --set data.val_fraction="
           f"{min(0.5, max(0.3, 2 * val_fraction)):g}) or more samples per client (data.partition_params, e.g. "
           f"nway_kshot's shots)")
    if metric.startswith("val_"):
        sizes = next((s for s in map(_val_sizes, done.get("run_dir", [])) if s), None)
        if sizes:
            med = float(np.median(sizes))
            if med < MIN_VAL_PER_CLIENT:
                out.append(f"the validation split holds a median of {med:g} samples per client (min {min(sizes)}; "
                           f"fewer than {MIN_VAL_PER_CLIENT}): {metric} moves in steps of about 1/{med:g} per client, "
                           f"too coarse to rank trials; {how}")
    values = [v for v in done.get("value", []) if v is not None and math.isfinite(v)]
    if len(values) >= 2:
        rounded = pd.Series(values).round(12)
        best = rounded.max() if trials.attrs.get("direction", "maximize") == "maximize" else rounded.min()
        tied = int((rounded == best).sum())
        if tied > 1:
            out.append(f"{tied} of {len(values)} finished trials tie at the best value {best:.6g}: the objective "
                       f"cannot rank them" + (f"; {how}" if metric.startswith("val_") else ""))
    return out


def _storage_url(target: str) -> str:
    """A tune output directory (its study.journal) or a storage URL, which must exist (nothing is created)."""
    p = Path(target)
    if p.is_dir():
        journal = p / "study.journal"
        if not journal.is_file():
            raise ConfigError("--show", f"{target} holds no study.journal (give a raysim tune output directory, or "
                                        f"the study's --storage URL)")
        return f"journal:{journal}"
    if target.startswith("sqlite:///"):
        db = Path(target[len("sqlite:///"):]).expanduser()
        if not db.is_file():
            raise ConfigError("--show", f"no SQLite database at {db}")
        return target
    if "://" in target:
        return target
    path = Path(target[len("journal:"):] if target.startswith("journal:") else target).expanduser()
    if not path.is_file():
        raise ConfigError("--show", f"{target} is neither a tune output directory nor an existing study storage")
    return f"journal:{path}"


def load_study(target: str, study_name: Optional[str] = None):
    import optuna

    from tuning.storage import open_storage

    url = _storage_url(target)
    store = open_storage(url)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    names = optuna.study.get_all_study_names(store)
    if study_name is None:
        if len(names) != 1:
            raise ConfigError("--study-name", f"{url} holds {len(names)} studies ({', '.join(names) or 'none'}); "
                                              f"name one with --study-name")
        study_name = names[0]
    elif study_name not in names:
        raise ConfigError("--study-name", f"no study {study_name!r} in {url}; its studies: {', '.join(names) or 'none'}")
    return optuna.load_study(study_name=study_name, storage=store)


def show(target: str, study_name: Optional[str] = None, top: int = 20) -> str:
    """The study as text: objective, best trial, trials sorted by value, parameter importances, warnings."""
    import optuna

    from raysim.io.results import markdown_table
    from tuning.export import trials_frame

    study = load_study(target, study_name)
    df = trials_frame(study)
    space = study.user_attrs.get("space") or {}
    obj = space.get("objective") or {}
    metric = obj.get("metric", "?")
    maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
    df.attrs["direction"] = "maximize" if maximize else "minimize"
    states = df["state"].value_counts().to_dict() if len(df) else {}
    lines = [f"study {study.study_name!r}: {obj.get('mode', '?')} {metric}, "
             f"{'maximised' if maximize else 'minimised'}; {len(df)} trial(s) {states}"]
    done = df[df["state"] == "COMPLETE"] if len(df) else df
    if len(done):
        bt = study.best_trial
        lines.append(f"best: trial {bt.number}, value {bt.value:.6g}, "
                     + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in bt.params.items())
                     + f"; run {bt.user_attrs.get('run_dir')}")
    else:
        lines.append("best: no finished trial yet")
    if len(df):
        order = df.assign(_done=df["state"] != "COMPLETE").sort_values(["_done", "value", "number"],
                                                                       ascending=[True, not maximize, True])
        cols = ["number", "value", "state"] + [c for c in df.columns if c.startswith("params_")] + ["seed", "seconds"]
        shown = order[cols].rename(columns=lambda c: c.removeprefix("params_")).head(top)
        lines.append(f"\ntrials by value (best first{'; first ' + str(top) if len(df) > top else ''}):\n")
        lines.append(markdown_table(shown).rstrip())
    lines.append("\nparameter importances (optuna.importance.get_param_importances, its default evaluator, over the "
                 "finished trials):")
    import warnings

    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            imp = optuna.importance.get_param_importances(study)
        lines += [f"  {k:<40} {v:.3f}" for k, v in imp.items()] or ["  none (no tuned parameter varied)"]
        lines += [f"  note: {str(w.message).splitlines()[0]}" for w in said]  # e.g. too few trials to tell
    except Exception as e:  # no finished trial, one value everywhere ...
        lines.append(f"  not available: {(str(e).splitlines() or [type(e).__name__])[0]}")
    base = study.user_attrs.get("base_config") or {}
    frac = float((base.get("data") or {}).get("val_fraction") or 0.0)
    lines += [f"WARNING: {w}" for w in validation_warnings(df, metric, frac)]
    return "\n".join(lines)

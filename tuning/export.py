"""A study's results on disk: every trial as a table (parameters, value, outcome, run directory), the best trial's
config, the seeds it was tuned on (report on others), written under the study's ``--out``."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pandas as pd
import yaml

from raysim.config import to_dict
from tuning.space import SearchSpace, trial_config


@dataclass
class TuneResult:
    study_name: str
    out_dir: Path
    trials: pd.DataFrame
    best_params: dict
    best_value: Optional[float]
    ran: int  # trials run by this call
    wall_s: float
    files: dict = field(default_factory=dict)
    warnings: list = field(default_factory=list)  # the validation split cannot rank the trials (tuning/show.py)


def trial_outcome(t) -> Optional[str]:
    return t.user_attrs.get("outcome")


def trials_frame(study) -> pd.DataFrame:
    """number, state, outcome, value, params_<key>..., seed, config_hash, run_dir, reason, last_round, seconds."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        row = {"number": t.number, "state": t.state.name, "outcome": trial_outcome(t), "value": t.value}
        for key, v in sorted(t.params.items()):
            row[f"params_{key}"] = v
        a = t.user_attrs
        row.update({"seed": a.get("seed"), "config_hash": a.get("config_hash"), "run_dir": a.get("run_dir"),
                    "reason": a.get("fail_reason") or a.get("prune_reason"), "last_round": a.get("last_round"),
                    "seconds": a.get("seconds"), "retry_of": a.get("retry_of"),
                    "datetime_start": t.datetime_start, "datetime_complete": t.datetime_complete})
        rows.append(row)
    return pd.DataFrame(rows)


def tuned_seeds(df: pd.DataFrame) -> list[int]:
    """The seeds a study's trials ran (trials.parquet column ``seed``; study attribute ``tuned_seeds``)."""
    if df.empty or "seed" not in df:
        return []
    return sorted({int(x) for x in df["seed"].dropna()})


def export(study, out_dir: Path, base: dict, space: SearchSpace) -> TuneResult:
    import optuna

    df = trials_frame(study)
    seeds = tuned_seeds(df)
    study.set_user_attr("tuned_seeds", seeds)
    files = {"trials": out_dir / "trials.parquet"}
    tmp = out_dir / ".trials.parquet.tmp"
    df.to_parquet(tmp, index=False)
    tmp.replace(files["trials"])
    complete = [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE]
    best_params, best_value = {}, None
    if complete:
        bt = study.best_trial
        best_params, best_value = dict(bt.params), bt.value
        cfg = trial_config(base, space, best_params, bt.number)
        best = to_dict(cfg)
        best["output"]["progress"] = True
        header = (f"# best trial {bt.number} of study {study.study_name!r}: {space.objective.mode} "
                  f"{space.objective.metric} = {bt.value:.6g}\n# tuned: "
                  + ", ".join(f"{k}={v!r}" for k, v in best_params.items()) + "\n"
                  + f"# tuned on seeds: {', '.join(str(x) for x in seeds)} (compare methods on other seeds)\n")
        files["best"] = out_dir / "best.yaml"
        files["best"].write_text(header + yaml.safe_dump(best, sort_keys=False))
    return TuneResult(study.study_name, out_dir, df, best_params, best_value, 0, 0.0, files)

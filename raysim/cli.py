"""The ``raysim`` command: ``run``, ``list`` (``tune`` and ``report`` come with the tuning issue).

Exit codes: 0 ok, 1 the simulation failed, 2 a bad config or bad data (one message naming the field)."""
from __future__ import annotations

import argparse
import sys

from raysim.config import ConfigError
from raysim.data.datasets import DataError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="raysim", description="Simulation engine for heterogeneous federated learning")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one experiment from a YAML config")
    run.add_argument("config", help="YAML config file")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config value by dotted key, e.g. --set algorithm.params.lam=0.5 (repeatable)")
    run.add_argument("--out", default=None, help="run directory (default: output.dir/<run id>)")
    run.add_argument("--backend", choices=["sequential", "ray"], default=None, help="shortcut for --set backend.name=...")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    sub.add_parser("list", help="list algorithms, datasets, partitioners and model architectures")
    return p


def _cmd_list() -> int:
    from raysim.data.datasets import LOADERS
    from raysim.data.partition import PARTITIONERS, partition_params
    from raysim.models import ARCHS, arch_params
    from raysim.registry import ALGORITHMS, algorithm_class

    print("algorithms:")
    for name in sorted(ALGORITHMS):
        cls = algorithm_class(name)
        import dataclasses

        params = ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls.Params))
        print(f"  {name:<12} {params}")
    print("datasets:")
    for name in LOADERS:
        print(f"  {name}")
    print("partitioners:")
    for name in PARTITIONERS:
        print(f"  {name:<12} {', '.join(partition_params(name))}")
    print("model architectures:")
    for name in ARCHS:
        print(f"  {name:<12} {', '.join(arch_params(name))}")
    return 0


def _cmd_run(args) -> int:
    from raysim.config import load_config
    from raysim.server import run_experiment

    overrides = list(args.overrides)
    if args.backend:
        overrides.append(f"backend.name={args.backend}")
    cfg = load_config(args.config, overrides)
    result = run_experiment(cfg, out_dir=args.out, progress=not args.no_progress)
    mean, std = result.final("test_acc")
    print(f"run {result.run_id}: final mean local test accuracy {mean:.4f} ± {std:.4f} over {cfg.data.num_clients} clients")
    if (result.table["metric"] == "test_acc_proto").any():
        pm, ps = result.final("test_acc_proto")
        print(f"  with prototypes: {pm:.4f} ± {ps:.4f}")
    comm = result.table[(result.table["scope"] == "total") & (result.table["metric"] == "up_floats")]["value"].mean()
    print(f"  uploaded floats per round (all clients): {comm:,.0f}")
    sim = result.table[(result.table["scope"] == "env") & (result.table["metric"] == "sim_time")]["value"]
    if len(sim):
        print(f"  simulated time: {sim.iloc[-1]:,.1f} s (environment: {cfg.env.get('preset') or 'custom'})")
    print(f"results: {result.out_dir / 'results.parquet'}")
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "list":
            return _cmd_list()
        return _cmd_run(args)
    except (ConfigError, DataError) as e:
        print(f"raysim: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("raysim: interrupted; no results written", file=sys.stderr)
        return 130
    except Exception as e:
        from raysim.runtime import SimulationError

        if isinstance(e, SimulationError):
            print(f"raysim: simulation failed: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())

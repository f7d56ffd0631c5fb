"""The body of the entry scripts (scripts/train_flux.py, train_sd3.py, train_wan.py): `difrl train` for one model kind.

    python scripts/train_flux.py configs/flux_tiny.yaml [key=value ...] [--out DIR]
    accelerate launch --num_processes 8 scripts/train_flux.py configs/flux_flow_grpo.yaml model.path=/models/FLUX.1-dev

Loads the typed config (dotted overrides), checks that it is for this script's model kind, runs
difrl.train.flow.train (the one trainer), and prints the evaluation before and after on the main
process. Config and input errors end with one line naming the problem and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def main(kind: str, argv: list[str] | None = None, description: str | None = None) -> int:
    from difrl.utils.quiet import quiet_third_party

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # difrl never downloads at run time
    quiet_third_party()  # before anything imports transformers / diffusers

    from difrl.config import ConfigError
    from difrl.rewards import RewardError

    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", help="a YAML config (configs/*.yaml)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides, e.g. model.path=/models/x train.lr=1e-5")
    ap.add_argument("--out", help="run directory (default: the config's `out`)")
    args = ap.parse_args(argv)
    name = Path(sys.argv[0]).name
    try:
        from difrl.train.flow import train

        from difrl.train.recipes import load_train_config

        cfg = load_train_config(args.config, args.overrides)  # any world's config: a wrong one is named below
        if cfg.model.kind != kind:
            script = Path(sys.argv[0]).with_name(f"train_{cfg.model.kind}.py")
            other = f"scripts/{script.name} {args.config} or " if script.is_file() else ""
            raise ValueError(f"{args.config} is a model.kind={cfg.model.kind} config; this script trains {kind} "
                             f"(use {other}difrl train {args.config})")
        summary = train(cfg, out_dir=args.out)
    except (ConfigError, RewardError, FileNotFoundError, ValueError) as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        before, after = summary["eval_before"], summary["eval_after"]
        change = summary.get("reward_change")
        noise = (f" ({change['delta']:+.4f}; sampling noise of the difference {change['noise']:.4f}, "
                 f"{after.get('samples', '?')} fixed-seed samples)") if change else ""
        print(f"\n{name}: {summary['iterations']} iterations; eval reward {before['reward']:.4f} -> {after['reward']:.4f}{noise}")
        from difrl.train.scaffold import run_files

        print(run_files(Path(summary["run_dir"])))
    return 0

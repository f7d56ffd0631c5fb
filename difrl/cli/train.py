"""`difrl train`: a config (or resume=RUN_DIR), checked as `difrl check` checks it, trained by the recipe model.kind
picks; the before/after table and the run's files at the end.

    difrl train configs/digits.yaml [key=value ...] [--out DIR] [--overwrite]
    difrl train resume=DIR [train.iterations=N ...]               # continue a run with its config.yaml
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from difrl.cli.args import split
# `key=value`'s value, and `difrl train resume=R [CONFIG] [key=value ...]`'s config: shared with the entry scripts
from difrl.train.entry import given, load_resume_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", help="run directory (default: the config's `out`, else runs/flow); with resume=, the "
                                 "same directory or nothing")
    p.add_argument("--overwrite", action="store_true", help="train into a run directory that holds a run: its files "
                                                             "are removed first (without it such a directory is refused)")
    p.add_argument("rest", nargs="*", help="CONFIG [key=value ...], or resume=RUN_DIR [key=value ...] (the run's "
                                           "config.yaml)")


def main(args) -> int:
    from difrl.train.check import checked_config
    from difrl.train.run.interrupt import Interrupted, stop_on_signals
    from difrl.train.recipes import train_function

    path, overrides = split(args.rest)
    main_process = int(os.environ.get("RANK", "0")) == 0  # under torchrun / accelerate launch, one process reports
    resume = given(overrides, "resume")
    if path is None and not resume:
        raise SystemExit("difrl train: give a config file, e.g. difrl train configs/digits.yaml (or resume=RUN_DIR)")
    # SIGINT / SIGTERM: a checkpoint, one line with the command that continues the run as it was launched (the
    # launcher and its options kept, `train resume=RUN_DIR` as the arguments), exit 130 / 143 (difrl.train.run.interrupt)
    with stop_on_signals(program=("train",), argv=args.argv):
        # resume=: the run's own config.yaml; a change of anything but the safe keys is refused (difrl.train.run.rundir),
        # and the run directory is the resumed one: --out or out= naming another is refused there too
        # every problem of the config at once, before anything loads (difrl.train.check, as `difrl check` says them)
        cfg = checked_config(path, overrides, load_resume_config(path, overrides) if resume else None)
        out = args.out or (given(overrides, "out") if resume else None)
        try:
            summary = train_function(cfg)(cfg, out_dir=out, overwrite=args.overwrite)
        except Interrupted as e:
            if main_process:
                print(f"difrl: {e}", file=sys.stderr)
            return e.code
    if not main_process:
        return 0
    before, after = summary["eval_before"], summary["eval_after"]
    run = Path(summary["run_dir"])
    print(f"\ndifrl: {summary['iterations']} iterations" + (f", stopped early: {summary['stopped_early']}" if summary["stopped_early"] else ""))
    # the metrics the world reports before / after (World.before_after_keys: its own, then its headline) that this
    # evaluation has, then the named rewards
    keys = [k for k in summary["before_after"] if k in after]
    keys += [k for k, v in after.items() if k.startswith("reward/") and isinstance(v, (int, float))]
    width = max(16, *(len(k) + 2 for k in keys))
    print(f"{'':<{width}}{'before':>10}{'after':>10}")
    for key in keys:
        print(f"{key:<{width}}{before[key]:>10.3f}{after[key]:>10.3f}")
    if "real_diversity" in after:
        print(f"real data diversity {after['real_diversity']:.3f}; FD features: {after['fd_extractor']}")
    from difrl.train.scaffold import run_files

    print(run_files(run))
    return 0

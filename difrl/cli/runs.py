"""The commands on a finished run directory: `difrl report` (its self-contained report.html) and `difrl export` (a
checkpoint as the plain final weights). `difrl compare` (several runs on one page) is difrl.report.compare_page.

    difrl report runs/digits
    difrl export runs/flux [--iteration N] [--out DIR]            # a (sharded) checkpoint as transformer/, lora/, ...
"""

from __future__ import annotations

import argparse


def add_report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run directory")


def write_run_report(args) -> int:
    from difrl.report import checked_run_dir, write_report

    print(f"report: {write_report(checked_run_dir(args.run_dir))}")
    return 0


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run directory")
    p.add_argument("--iteration", type=int, help="the checkpoint of this iteration (default: the newest intact one)")
    p.add_argument("--out", help="where to write them (default: RUN_DIR/export/iter-NNNNNN; must be empty)")


def export_run(args) -> int:
    from difrl.train.export import export

    export(args.run_dir, args.iteration, args.out)
    return 0

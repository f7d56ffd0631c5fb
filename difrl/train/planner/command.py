"""`difrl plan CONFIG [key=value ...] --gpus N [N ...] [--gpu-memory GiB] [--arch NAME] [--json PATH]`: the command.

    difrl plan configs/flux_flow_grpo.yaml train.lora.enabled=false train.grad_accum=24 train.kl_beta=0.04 \\
        --gpus 8 --gpu-memory 80 --json plan.json
    difrl plan configs/text_arithmetic.yaml model.path=/models/LLaDA-8B-Instruct --gpus 1 8 16 --gpu-memory 80

A flow config is planned by difrl/train/planner/flow.py (plan_flow), a masked one by difrl/train/planner/masked.py
(plan_masked); both give rows of planner.plan_row's schema, printed here as a table with a verdict per row.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from difrl.train.planner.flow import FIT_MARGIN, NOT_SIMULATED, plan_flow


def format_rows(rows: list[dict]) -> str:
    """A plain table of the rows for the terminal."""
    cols = ("arch", "method", "gpus", "peak_gib", "setup_peak_gib", "params_gib", "grads_gib", "unsharded_grads_gib",
            "optimizer_gib", "activations_gib", "reference_gib", "ema_gib", "frozen_gib", "fits")
    lines = [" | ".join(cols)]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, 0.0)
            cells.append(f"{v:.2f}" if isinstance(v, float) else str(v))
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def plan_run(cfg, gpus: int, gpu_memory_gib: float | None = None, arch: str | None = None, config_name: str = "") -> dict:
    """The row of the trainer the config's model.kind names: plan_masked for a MaskedConfig, plan_flow otherwise."""
    from difrl.train.masked.config import MaskedConfig
    from difrl.train.planner.masked import plan_masked

    run = plan_masked if isinstance(cfg, MaskedConfig) else plan_flow
    return run(cfg, gpus, gpu_memory_gib, arch, config_name=config_name)


def main(args: argparse.Namespace, load_config) -> int:
    """`difrl plan CONFIG [key=value ...] --gpus N [--gpu-memory GiB] [--arch NAME] [--json PATH]`."""
    cfg = load_config(args.config, args.overrides)
    rows = [plan_run(cfg, n, args.gpu_memory, args.arch, config_name=args.config) for n in args.gpus]
    print(format_rows(rows))
    for r in rows:
        if r["fits"] is not None:
            verdict = "fits" if r["fits"] else "does NOT fit"
            print(f"difrl plan: {r['arch']} {r['method']} on {r['gpus']} GPU(s): peak {max(r['peak_gib'], r['setup_peak_gib']):.1f} "
                  f"GiB per GPU ({r['peak_phase']}; setup {r['setup_peak_gib']:.1f}) {verdict} {args.gpu_memory:g} GiB "
                  f"(at most {FIT_MARGIN:.0%} of it: allocator and NCCL headroom)")
    print(f"simulated, not measured on a GPU; not simulated: {', '.join(NOT_SIMULATED)}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
        print(f"difrl plan: {len(rows)} row(s) written to {args.json}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="a flow or masked (hf_masked) config (YAML); model.path may be a placeholder: the "
                                  "family's reference architecture is simulated (LLaDA-8B for hf_masked)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, as for difrl train")
    p.add_argument("--gpus", type=int, nargs="+", default=[1], help="processes (GPUs) to simulate; several: one row each")
    p.add_argument("--gpu-memory", type=float, default=None, help="GiB per GPU for the verdict (e.g. 80, 141)")
    p.add_argument("--arch", default=None, help="a shipped architecture (difrl/assets/arch/) instead of the family's "
                                                "reference checkpoint (llada-8b for a masked config)")
    p.add_argument("--json", default=None, help="write the rows to this file as a JSON list")



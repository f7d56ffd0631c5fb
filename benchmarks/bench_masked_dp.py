"""Data parallelism of the dLLM trainer: seconds per iteration of the masked text trainer on 2 processes vs 1 process
with the same global batch (CPU, gloo).

    .venv/bin/python benchmarks/bench_masked_dp.py --json benchmarks/results/bench_masked_dp.json   # ~4 min
    .venv/bin/python benchmarks/bench_masked_dp.py --quick                                          # ~1 min, no write

configs/text_arithmetic.yaml (the bundled tiny BertForMaskedLM, LLaDA rollouts, MaskGRPO with 4 inner updates,
micro_batch auto with train.updates_per_epoch=1: one optimizer update of all samples per inner update, so every launch
makes the same updates) is trained with `threads=1` per
process, no evaluation during training and no checkpoints, three ways with the same global batch and the same keys:
one process (`python -m difrl train`), 2 processes under DDP (`accelerate launch --config_file
configs/accelerate/ddp.yaml --num_processes 2`) and 2 under FSDP2 (configs/accelerate/fsdp.yaml). One thread per
process, so 2 processes on 2 cores compare fairly with 1 process on 1 thread (the second core idles there): the
ratio is what splitting the samples buys, not more threads. A launch's seconds per iteration is the median of its
metrics.jsonl `seconds` (the main process's wall clock of an iteration; every process waits for the others at the
gathers) over its iterations after the first (warm-up); each launch kind runs `--repeats` times, interleaved, and
the table gives the median over repeats. The runs train the same thing: their reward rows are compared too
(tests/test_masked_dp.py checks equality within rtol 1e-5).

What this is not: a GPU or NCCL measurement (none was run), nor a quiet machine: on a machine shared with other
jobs both sides are inflated, and by different amounts when the load changes between launches (the load average
before each launch is in the rows and in the block).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import publish, standard_args  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- bench_masked_dp:start -->", "<!-- bench_masked_dp:end -->"
CONFIG = ROOT / "configs" / "text_arithmetic.yaml"
LAUNCHES = {"1 process": (1, None), "2 processes, DDP": (2, "ddp"), "2 processes, FSDP2": (2, "fsdp")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(out: Path, nproc: int, launch: str | None, keys: list[str]) -> list[dict]:
    """One training launch; its metrics rows."""
    args = ["-m", "difrl", "train", str(CONFIG), *keys, "--out", str(out), "--overwrite"]
    cmd = [sys.executable, *args] if nproc == 1 else [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file",
        str(ROOT / "configs" / "accelerate" / f"{launch}.yaml"), "--num_processes", str(nproc),
        "--main_process_port", str(free_port()), *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]


def measure(name: str, nproc: int, launch: str | None, keys: list[str], repeat: int, runs: Path) -> dict:
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    rows = train(runs / f"{name.replace(' ', '_').replace(',', '')}-{repeat}", nproc, launch, keys)
    wall = time.perf_counter() - t0
    later = rows[1:]  # the first iteration warms up (allocations, lazy init)
    return {"launch": name, "processes": nproc, "repeat": repeat, "threads_per_process": 1,
            "seconds_per_iteration": statistics.median(r["seconds"] for r in later),
            "seconds_rollout": statistics.median(r["seconds_rollout"] for r in later),
            "seconds_update": statistics.median(r["seconds_update"] for r in later),
            "iterations_timed": len(later), "command_seconds": wall, "load_before": load,
            "reward_mean": [r["reward_mean"] for r in rows]}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    standard_args(ap, "64 samples per iteration, 3 iterations, one repeat, 1 process and DDP only")
    ap.add_argument("--iterations", type=int, default=8, help="iterations per launch (the first is not timed)")
    ap.add_argument("--repeats", type=int, default=2, help="launches of each kind, interleaved")
    ap.add_argument("--runs", type=Path, help="run directories (default: a temporary directory)")
    args = ap.parse_args(argv)
    its, repeats = (3, 1) if args.quick else (args.iterations, args.repeats)
    prompts = 8 if args.quick else 16
    launches = {k: v for k, v in LAUNCHES.items() if not (args.quick and v[1] == "fsdp")}
    # one optimizer update per inner update: the launches then make the same updates (with 2, each process shuffles
    # its own samples, so which samples share an update differs from one process's; the work is the same)
    keys = ["threads=1", "seed=0", f"train.iterations={its}", "eval.every=0", "checkpoint_every=0", "train.updates_per_epoch=1",
            f"rollout.prompts_per_iter={prompts}", "eval.count=8", "eval.samples=2", "eval.pass_k=[1]"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        runs = args.runs or Path(tmp)
        for repeat in range(repeats):
            for name, (nproc, launch) in launches.items():
                rows.append(measure(name, nproc, launch, keys, repeat, runs))
                print(f"{name} (repeat {repeat + 1}): {rows[-1]['seconds_per_iteration']:.3f} s/iteration "
                      f"(load average {rows[-1]['load_before']:.1f} before)", flush=True)
    lines, summary = report(rows, its, prompts * 8)
    rows += summary  # the block's medians and ratios, so every number it prints is in the JSON too
    publish(args, BEGIN, END, "Data-parallel dLLM trainer: seconds per iteration, 1 vs 2 processes (CPU, gloo)",
            "bench_masked_dp.py", argv, lines, rows)
    return rows


def report(rows: list[dict], its: int, samples: int) -> tuple[list[str], list[dict]]:
    """The table and the sentences, every number from `rows` (one per launch); and the summary rows (one per launch
    kind: the medians and the ratio to one process the block prints)."""
    by = {}
    for r in rows:
        by.setdefault(r["launch"], []).append(r)
    med = {k: statistics.median(r["seconds_per_iteration"] for r in v) for k, v in by.items()}
    summary = [{"launch": k, "summary": True, "processes": v[0]["processes"], "seconds_per_iteration_median": med[k],
                "seconds_rollout_median": statistics.median(r["seconds_rollout"] for r in v),
                "seconds_update_median": statistics.median(r["seconds_update"] for r in v), "launches": len(v),
                "speed_vs_one_process": med["1 process"] / med[k], "samples_per_iteration": samples, "iterations": its,
                "launches_total": len(rows)} for k, v in by.items()]
    lines = ["| launch | processes x threads | s / iteration (median) | rollout s | update s | launches |",
             "|---|---|---|---|---|---|"]
    for k, v in by.items():
        lines.append(f"| {k} | {v[0]['processes']} x 1 | {med[k]:.3f} | "
                     f"{statistics.median(r['seconds_rollout'] for r in v):.3f} | "
                     f"{statistics.median(r['seconds_update'] for r in v):.3f} | {len(v)} |")
    one = med["1 process"]
    loads = [r["load_before"] for r in rows]
    lines += ["", f"configs/text_arithmetic.yaml with {samples} samples per iteration (the same global batch on every "
                  f"launch, one optimizer update of all of them per inner update), {its} iterations per launch, the first not timed. On 2 processes under DDP an iteration "
                  f"took {med['2 processes, DDP']:.3f} s against {one:.3f} s on one process: "
                  f"{one / med['2 processes, DDP']:.2f}x as fast (2x would be perfect scaling)."]
    if "2 processes, FSDP2" in med:
        lines[-1] += (f" Under FSDP2 (the model sharded too, gathered per block in every forward): "
                      f"{med['2 processes, FSDP2']:.3f} s, {one / med['2 processes, FSDP2']:.2f}x.")
    same = all(r["reward_mean"] == by["1 process"][0]["reward_mean"] for r in rows)
    worst = max(abs(a - b) / max(abs(b), 1e-12) for r in rows
                for a, b in zip(r["reward_mean"], by["1 process"][0]["reward_mean"]))
    lines += ["", f"The launches trained the same samples: every iteration's reward_mean "
                  f"{'is identical' if same else f'agrees within a relative {worst:.1e}'} across all {len(rows)} launches.",
              "", f"CPU processes over gloo on this machine's {os.cpu_count()} cores, one torch thread per process, so "
                  "2 processes use 2 cores where one process uses 1: the ratio is what splitting the samples over "
                  "processes buys, not extra threads. The machine was shared with other jobs (1-minute load average "
                  f"{min(loads):.1f} to {max(loads):.1f} before the launches), which inflates both sides, by different "
                  "amounts as the load moves. No GPU and no NCCL were measured."]
    return lines, summary


if __name__ == "__main__":
    main()

"""The real-model path learns: FLUX.1, SD3 and Wan 2.1 tiny pipelines raise a checkpoint-free reward, on 1 and 2 processes.

    python benchmarks/bench_models.py                      # 3 families x 3 seeds + a 2-process run each; writes BENCHMARKS.md
    python benchmarks/bench_models.py --quick --json /tmp/models.json   # 1 seed, 12 iterations, no 2-process run

For each family: `scripts/make_tiny_pipeline.py <kind>` (built in code, nothing downloaded), then
`scripts/train_<kind>.py configs/<kind>_tiny.yaml seed=S` in a fresh process per seed, and once more under
`accelerate launch --multi_gpu --num_processes 2 ... train.grad_accum=2` (the same global batch per update).
Every number comes from the runs' summary.json / metrics.jsonl: the evaluation reward before and after
(16 fixed-seed samples; the same for every seed before training), its sampling noise (the summary's
`reward_change.noise`), seconds per training iteration (mean of the `seconds` column), and the peak resident
memory of the training process (ru_maxrss; for 2 processes the largest of the launcher's processes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import mean_std, publish, standard_args  # noqa: E402

BEGIN, END = "<!-- bench_models:begin -->", "<!-- bench_models:end -->"
KINDS = ("flux", "sd3", "wan")
# runs a command and prints the largest peak RSS (KiB on Linux) among its processes: ru_maxrss of RUSAGE_CHILDREN
# covers every descendant that was waited for (the accelerate launcher's training processes included)
_WRAP = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
         "print('PEAK_RSS_KIB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(code)")


def _env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}


def train_run(kind: str, pipe: Path, out: Path, seed: int, nproc: int, overrides: list[str], reuse: bool = False) -> dict:
    if reuse and (out / "bench_row.json").is_file():  # --reuse: a finished run of this work directory
        return json.loads((out / "bench_row.json").read_text())
    script = [str(ROOT / "scripts" / f"train_{kind}.py"), str(ROOT / "configs" / f"{kind}_tiny.yaml"),
              f"model.path={pipe}", f"seed={seed}", *overrides]
    if nproc == 1:
        cmd = [sys.executable, *script]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(nproc),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", *script,
               "train.grad_accum=2"]
    proc = subprocess.run([sys.executable, "-c", _WRAP, *cmd, "--out", str(out), "--overwrite"], env=_env(),
                          capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} seed {seed} on {nproc} process(es) failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    peak_kib = int(next(ln.split()[1] for ln in proc.stdout.splitlines() if ln.startswith("PEAK_RSS_KIB")))
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    change = summary["reward_change"]
    row = {"kind": kind, "seed": seed, "processes": nproc, "iterations": summary["iterations"],
           "before": change["before"], "after": change["after"], "delta": change["delta"], "noise": change["noise"],
           "s_per_iter": statistics.mean(r["seconds"] for r in rows), "peak_rss_mib": peak_kib / 1024}
    (out / "bench_row.json").write_text(json.dumps(row))
    return row


def tracked_iterations(a: Path, b: Path, tol: float = 1e-5) -> int:
    """Leading iterations whose rollout reward (reward_mean) agrees between two runs within `tol`: how long a
    2-process run follows the 1-process one before float rounding differences (reduction order) compound."""
    ra, rb = ([json.loads(ln)["reward_mean"] for ln in (d / "metrics.jsonl").read_text().splitlines()] for d in (a, b))
    n = 0
    while n < min(len(ra), len(rb)) and abs(ra[n] - rb[n]) <= tol:
        n += 1
    return n


def _mean_std(xs: list[float]) -> tuple[float, float]:
    return mean_std(xs)  # mean and sample standard deviation (common.sample_std)


def summary_row(kind: str, one: list[dict], two: dict | None) -> dict:
    """Every figure the table and the verdict derive from a family's runs, as a row of the JSON (so that
    scripts/check_claims.py finds each printed number in benchmarks/results/bench_models.json)."""
    deltas = [r["delta"] for r in one]
    d, sd = _mean_std(deltas)
    a, sa = _mean_std([r["after"] for r in one])
    noise, lowest = max(r["noise"] for r in one), min(deltas)
    row = {"kind": kind, "summary": True, "seeds": len(one), "after_mean": a, "after_std": sa, "delta_mean": d,
           "delta_std": sd, "noise_max": noise, "delta_min": lowest, "delta_min_over_noise": round(lowest / noise),
           "s_per_iter_mean": _mean_std([r["s_per_iter"] for r in one])[0],
           "peak_rss_mib_max": max(r["peak_rss_mib"] for r in one)}
    if two is not None:
        ref = next(r for r in one if r["seed"] == two["seed"])
        row.update({"two_process_gap": abs(two["after"] - ref["after"]), "two_process_spread": max(sd, noise)})
    return row


def verdict(kind: str, one: list[dict], two: dict | None) -> str:
    """One sentence per family, every number from the rows."""
    deltas = [r["delta"] for r in one]
    d, sd = _mean_std(deltas)
    noise = max(r["noise"] for r in one)
    lowest = min(deltas)
    if len(one) > 1:
        if lowest > 0 and lowest > 3 * noise and d - sd > 0:
            word = (f"raised the reward in every seed: +{d:.4f} ± {sd:.4f} over {len(one)} seeds; the smallest gain "
                    f"(+{lowest:.4f}) is {lowest / noise:.0f}x the evaluation's sampling noise ({noise:.4f})")
        else:
            word = (f"no clear gain: {d:+.4f} ± {sd:.4f} over {len(one)} seeds against sampling noise {noise:.4f} "
                    f"(smallest gain {lowest:+.4f})")
    else:
        word = f"{d:+.4f} with one seed (sampling noise {noise:.4f}); one seed gives no spread, so no claim"
    same = ""
    if two is not None:
        ref = next(r for r in one if r["seed"] == two["seed"])
        gap = abs(two["after"] - ref["after"])
        spread = max(sd, noise)
        n, total = two["tracked_iterations"], two["iterations"]
        follow = (f"for all {total} iterations" if n == total else
                  f"for {n} of {total} iterations (then float rounding differences compound)")
        same = (f"; 2 processes followed the 1-process run of the same seed within 1e-5 in rollout reward {follow} and "
                f"reached {two['after']:.4f} against {ref['after']:.4f} (difference {gap:.1e}, "
                f"{'within' if gap <= spread else 'BEYOND'} the larger of the seed spread and the sampling noise, "
                f"{spread:.4f})")
    return f"- {kind}: {word}{same}."


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    standard_args(ap, "1 seed x 12 iterations per family, no 2-process run (about 2 min)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--out", type=Path, help="work directory (default: a temporary one)")
    ap.add_argument("--reuse", action="store_true", help="with --out: take the rows of runs already finished there "
                                                         "(their bench_row.json) instead of training again")
    args = ap.parse_args(argv)
    seeds = [0] if args.quick else list(range(args.seeds))
    overrides = ["train.iterations=12"] if args.quick else []

    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = args.out or Path(tmp)
        for kind in args.kinds:
            pipe = work / f"tiny_{kind}"
            if not (args.reuse and pipe.is_dir()):
                subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_pipeline.py"), kind, str(pipe)],
                               env=_env(), check=True, capture_output=True, cwd=ROOT)
            for s in seeds:
                rows.append(train_run(kind, pipe, work / f"{kind}-s{s}", s, 1, overrides, args.reuse))
                print(json.dumps(rows[-1]), flush=True)
            if not args.quick:
                rows.append(train_run(kind, pipe, work / f"{kind}-2proc", 0, 2, overrides, args.reuse))
                rows[-1]["tracked_iterations"] = tracked_iterations(work / f"{kind}-s0", work / f"{kind}-2proc")
                print(json.dumps(rows[-1]), flush=True)

    one = lambda k: [r for r in rows if r["kind"] == k and r["processes"] == 1]
    two = lambda k: next((r for r in rows if r["kind"] == k and r["processes"] == 2), None)
    lines = [f"`configs/<kind>_tiny.yaml` on `scripts/make_tiny_pipeline.py <kind>` (random tiny weights, LoRA rank 4, "
             f"reward `color` (red), {rows[0]['iterations']} iterations of 32 samples), {len(seeds)} seed(s) on one "
             "process" + ("" if args.quick else "; seed 0 again under `accelerate launch --multi_gpu --num_processes 2 ... "
                                    "train.grad_accum=2`") + ". "
             "Eval reward: 16 fixed-seed ODE samples (identical for every seed before training); noise: the "
             "summary's sampling noise of after - before.", "",
             "| model | reward before | reward after (mean ± std over seeds) | gain | sampling noise | s/iter | "
             "peak RSS MiB | 2 processes: after | 2 processes: s/iter, peak RSS MiB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for k in args.kinds:
        o, t = one(k), two(k)
        a, sa = _mean_std([r["after"] for r in o])
        d, _ = _mean_std([r["delta"] for r in o])
        s, _ = _mean_std([r["s_per_iter"] for r in o])
        lines.append(f"| {k} | {o[0]['before']:.4f} | {a:.4f} ± {sa:.4f} | {d:+.4f} | {max(r['noise'] for r in o):.4f} | "
                     f"{s:.2f} | {max(r['peak_rss_mib'] for r in o):.0f} | "
                     + (f"{t['after']:.4f} | {t['s_per_iter']:.2f}, {t['peak_rss_mib']:.0f} |" if t else "– | – |"))
    lines += ["", *[verdict(k, one(k), two(k)) for k in args.kinds],
              "- Random tiny models: the gain shows that gradients from the reward move the real pipelines' samples "
              "through difrl's adapters, not what a real checkpoint would reach. How far a reward can move is bounded "
              "by the random VAE decoder (difrl/models/tiny.py, difrl/models/wan.py say by how much). CPU only; "
              "two processes share the machine's cores (gloo), so their seconds are not a speed-up measurement. "
              "Never run on a GPU."]
    rows += [summary_row(k, one(k), two(k)) for k in args.kinds]
    publish(args, BEGIN, END, "Real-model path: tiny FLUX / SD3 / Wan pipelines learn", "bench_models.py", argv, lines, rows)
    return rows


if __name__ == "__main__":
    main()

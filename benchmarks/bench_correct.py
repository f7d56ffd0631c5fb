"""Importance-sampling correctors and GRPO-Guard under an injected rollout/train mismatch, digits world.

    .venv/bin/python benchmarks/bench_correct.py --json benchmarks/results/bench_correct.json   # ~25 min, 2 cores
    .venv/bin/python benchmarks/bench_correct.py --quick --no-write                             # ~2 min
    .venv/bin/python benchmarks/bench_correct.py --render-from benchmarks/results/bench_correct.json  # the block again

Every run is configs/digits.yaml (Flow-GRPO, the demo) for a fixed budget of iterations, with the
trained rollouts coming from a rollout copy that differs from the trained policy: by default an
NVFP4 copy (W4A4, difrl.quant) refreshed only every 4 iterations (a stale policy, as in
asynchronous RL). The trainer recomputes the proximal log-probs, so PPO's ratio is against the
trained policy; the corrector weighs (or masks) each transition by pi_old / mu (difrl.correct).
Rows: the on-policy run without any mismatch (reference), no correction, token TIS (cap 2), token
MIS, sequence MIS, AIS, and GRPO-Guard (RatioNorm + 1/dt step weights) without an IS correction.
Accuracy (the reward's classifier), judge accuracy (an unseen SVM) and Fréchet distance are those
of the final evaluation, mean ± sample standard deviation over seeds (n printed); K3 and ESS/B are the mismatch the corrector saw.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SPREAD_NOTE, publish, republish, sample_std, standard_args, threads_override, write_json  # noqa: E402

from difrl.train.config import load_flow_config  # noqa: E402
from difrl.train.flow.trainer import train  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- bench_correct:start -->", "<!-- bench_correct:end -->"
METHODS = {
    "on-policy fp32 (no mismatch)": None,
    "no correction": ["correct.method=none"],
    "token TIS (cap 2)": ["correct.method=token_tis", "correct.options={cap: 2.0}"],
    "token MIS": ["correct.method=token_mis"],
    "sequence MIS": ["correct.method=seq_mis"],
    "AIS": ["correct.method=ais"],
    "GRPO-Guard (RatioNorm + 1/dt)": ["correct.method=none", "train.ratio_norm=true", "train.step_weight=inverse_dt"],
}
# the log-prob convention (specs §5.4): the per-element mean (difrl's default, Flow-GRPO's) or the sum over the
# 64 pixels, with the PPO clip range scaled by the same 64 so that it bounds the same step
SCENARIOS = {
    "mean": ("per-element mean log-probs (difrl default)", []),
    "sum": ("per-element sum log-probs (clip x 64)", ["sampler.log_prob_reduce=sum", "train.clip_low=0.064",
                                                      "train.clip_high=0.064"]),
}


def run_one(name: str, overrides: list[str] | None, mismatch: list[str], convention: list[str], seed: int,
            iterations: int, every: int, out: Path, threads: int | None = None) -> dict:
    """threads: the run's torch threads (config `threads`); None: the config's default (common.threads_override)."""
    extra = convention + ([] if overrides is None else [*mismatch, *overrides]) + threads_override(threads)
    run_dir = out / name.split(" (")[0].replace(" ", "_") / f"seed{seed}"
    cfg = load_flow_config(ROOT / "configs" / "digits.yaml", [*extra, f"seed={seed}", f"train.iterations={iterations}",
                                                             f"eval.every={every}", "stop.fd_rise=null"])
    summary = train(cfg, out_dir=run_dir, overwrite=True)
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    mean = lambda key: statistics.mean(r[key] for r in rows) if key in rows[0] else None
    ev = summary["eval_after"]
    return {"accuracy": ev["accuracy"], "judge": ev["judge_accuracy"], "fd": ev["fd"], "diversity": ev["diversity"],
            "kl_k3": mean("correct/kl_k3"), "ess_frac": mean("correct/ess_frac"), "masked_frac": mean("correct/masked_frac"),
            "reward_last10": statistics.mean(r["reward_mean"] for r in rows[-10:])}


def aggregate(per_seed: list[dict], **info) -> dict:
    """Mean and std over seeds of every per-seed number (None where a method has no such diagnostic)."""
    row = dict(info)
    for key in per_seed[0]:
        vals = [r[key] for r in per_seed if r[key] is not None]
        row[f"{key}_mean"] = statistics.mean(vals) if vals else None
        row[f"{key}_std"] = sample_std(vals) if vals else None
    row["per_seed"] = per_seed
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    standard_args(ap, "one seed, 20 iterations, three methods (~2 min)")
    ap.add_argument("--seeds", type=int, nargs="+", help="default 0 1 2 (--quick: 0)")
    ap.add_argument("--iterations", type=int, help="budget per run (default 100; --quick 20)")
    ap.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--mismatch", nargs="+", default=["rollout.precision=nvfp4", "rollout.sync_every=4"],
                    help="config overrides that make the rollout policy differ from the trained one")
    ap.add_argument("--methods", nargs="+", choices=list(METHODS), help="default all (--quick: 3)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_correct")
    ap.add_argument("--threads", type=int, help="torch threads, also the runs' (default: this process min(2, torch's), "
                    "the runs their config's default: OMP_NUM_THREADS when set, else every core)")
    ap.add_argument("--render-from", type=Path, help="re-render the published block from a full run's saved rows "
                    "(their per-seed values) instead of running")
    args = ap.parse_args(argv)
    if args.render_from:
        saved = json.loads(args.render_from.read_text())
        rows = [aggregate(r["per_seed"], **{k: v for k, v in r.items() if k != "per_seed" and not k.endswith(("_mean", "_std"))})
                for r in saved]  # the means and standard deviations again, from the per-seed values
        write_json(args.json or args.render_from, rows)
        mismatch = next((r["mismatch"] for r in rows if r["mismatch"] != "none"), " ".join(args.mismatch))
        republish(BEGIN, END, render(rows, mismatch, rows[0]["iterations"], rows[0]["seeds"]), args.render_from,
                  "bench_correct.py")
        return rows
    torch.set_num_threads(args.threads or min(2, torch.get_num_threads()))
    seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    iterations = args.iterations or (20 if args.quick else 100)
    methods = args.methods or (list(METHODS)[:3] if args.quick else list(METHODS))

    rows = []
    for scenario in args.scenarios:
        label, convention = SCENARIOS[scenario]
        for name in methods:
            per_seed = [run_one(name, METHODS[name], args.mismatch, convention, s, iterations, args.every,
                                args.out / scenario, args.threads) for s in seeds]
            rows.append(aggregate(per_seed, scenario=label, method=name, seeds=seeds, iterations=iterations,
                                  mismatch="none" if METHODS[name] is None else " ".join(args.mismatch),
                                  convention=convention))
            r = rows[-1]
            print(f"{scenario:4s} {name:32s} accuracy {r['accuracy_mean']:.3f} ± {r['accuracy_std']:.3f}  FD "
                  f"{r['fd_mean']:.1f} ± {r['fd_std']:.1f}  K3 {r['kl_k3_mean'] or 0:.2e}", flush=True)

    publish(args, BEGIN, END, "Correctors under a rollout/train mismatch (digits, Flow-GRPO)", "bench_correct.py", argv,
            render(rows, " ".join(args.mismatch), iterations, seeds), rows)
    return rows


def render(rows: list[dict], mismatch: str, iterations: int, seeds: list[int]) -> list[str]:
    """The block's lines from the rows (a run's, or saved ones: --render-from)."""
    fmt = lambda r, k, p: "–" if r[f"{k}_mean"] is None else f"{r[f'{k}_mean']:.{p}f} ± {r[f'{k}_std']:.{p}f}"
    table = ["| log-probs | method | accuracy | judge | FD | diversity | K3 per step | ESS/B | masked |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        k3 = "–" if r["kl_k3_mean"] is None else f"{r['kl_k3_mean']:.2e}"
        table.append(f"| {r['scenario']} | {r['method']} | {fmt(r, 'accuracy', 3)} | {fmt(r, 'judge', 3)} | {fmt(r, 'fd', 1)} | "
                     f"{fmt(r, 'diversity', 3)} | {k3} | {fmt(r, 'ess_frac', 4)} | {fmt(r, 'masked_frac', 4)} |")
    return [f"Mismatch: `{mismatch}` (none for the on-policy rows); {iterations} iterations per run; seeds {seeds} "
            f"(n={len(seeds)}); final evaluation (500 samples, 10 ODE steps); the FD stopping rule off. {SPREAD_NOTE}",
            "", *table]


if __name__ == "__main__":
    main()

"""Masked-diffusion GRPO estimators against each other, and external rollouts (ERILS) against
on-policy only: accuracy against wall-clock on the bundled discrete worlds, several seeds.

    .venv/bin/python benchmarks/bench_masked.py --json benchmarks/results/bench_masked.json   # ~60 min, 2 cores
    .venv/bin/python benchmarks/bench_masked.py --parts digit_tokens --no-write   # one part (run parts side by side,
    .venv/bin/python benchmarks/bench_masked.py --reuse                           #  then assemble them with --reuse)
    .venv/bin/python benchmarks/bench_masked.py --quick --no-write                # ~2 min

(a) Estimators (parts ``sudoku`` and ``digit_tokens``): the world's config (configs/sudoku.yaml,
configs/digit_tokens.yaml) with only the log-prob estimator changed, everything else (sampler,
lr, clip, KL, mu) the same, so the comparison is of estimators, not recipes:
  MaskGRPO      one fading-out AR-like (Sudoku) / uniform (digit tokens) re-mask per inner update, ratio
                swept c -> 1 over mu, loss on the re-masked tokens, advantages (r - mean) / std
  d1            every answer token masked (one view), loss on all of them, advantages r - mean
  UniGRPO       i.i.d. Bernoulli(p_n) re-mask, p_n from a random per-sample start up to 1 over mu
  coupled-GRPO  the full view plus complementary views A / B at t ~ U(0.2, 0.8) (3 views per forward),
                weights 1/t and 1/(1 - t), leave-one-out advantages
(b) ERILS (part ``erils``): Sudoku from a weaker base (scripts/pretrain_sudoku.py stopped at
--weak-steps), on-policy only against 1 of every 8 rollouts from the exact solver policy
(``external.source=solver``) or from the bundled base, a stronger checkpoint
(``external.source=checkpoint``), both with source normalisation and token-level TIS (cap 2).

Every run is one process on one thread (``threads=1``); two parts may run side by side, each on its
own core. A method's seconds per iteration is the fastest over its seeds of each run's own training
seconds (rollout + reward + update, evaluations excluded, from metrics.jsonl) per iteration, the
usual least-disturbed timing, so runs slowed by other work on the machine do not move it (their
per-seed values are in the JSON rows); its accuracy at a wall-clock budget is, per seed, the last
evaluation (every --every iterations) whose iteration x that time fits in the budget.
Budgets are 1/4, 1/2 and all of the slowest method's full run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import mean_std as seed_mean_std  # noqa: E402
from common import publish, sample_std, same_config, standard_args  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- bench_masked:start -->", "<!-- bench_masked:end -->"
ESTIMATORS = {
    "MaskGRPO": [],
    "d1": ["estimator.kind=d1", "advantage.scale=mean"],
    "UniGRPO": ["estimator.kind=unigrpo"],
    "coupled-GRPO": ["estimator.kind=coupled", "advantage.scale=loo"],
}
WORLDS = {"sudoku": ("sudoku.yaml", ("cell_accuracy", "solve_rate")),
          "digit_tokens": ("digit_tokens.yaml", ("accuracy", "fd"))}
ITERATIONS = {"sudoku": 150, "digit_tokens": 60, "erils": 100}  # per run, unless --iterations
ERILS = {
    "on-policy only": [],
    "ERILS, solver (1 of 8)": ["external.source=solver", "external.per_group=1"],
    "ERILS, stronger checkpoint (1 of 8)": ["external.source=checkpoint", "external.per_group=1",
                                            "external.path=difrl/assets/sudoku_base.safetensors"],
}
BUDGET_FRACTIONS = (0.25, 0.5, 1.0)  # of the slowest method's median training seconds


# ---------------------------------------------------------------------------------- runs
def run_one(world: str, overrides: list[str], run_dir: Path, reuse: bool, only_finished: bool = False) -> Path | None:
    from difrl.train.masked.trainer import train
    from difrl.train.masked.config import load_masked_config

    cfg = load_masked_config(ROOT / "configs" / WORLDS[world][0], ["threads=1", "checkpoint_every=0", *overrides])
    if (reuse or only_finished) and same_config(cfg, run_dir):
        print(f"reuse {run_dir}")
        return run_dir
    if only_finished:
        print(f"skip {run_dir}: no finished run of this config")
        return None
    train(cfg, out_dir=run_dir, overwrite=True)
    return run_dir


def weak_base(runs: Path, steps: int) -> Path:
    """The weaker Sudoku base for the ERILS part (scripts/pretrain_sudoku.py at `steps` steps)."""
    import torch

    sys.path.insert(0, str(ROOT / "scripts"))
    from pretrain_sudoku import train_base

    from difrl.discrete.policy import TinyMaskedPolicy
    from difrl.utils.io import save_safetensors

    path = runs / f"sudoku_weak_{steps}.safetensors"
    if not path.exists():
        torch.set_num_threads(1)
        tensors, meta = TinyMaskedPolicy(train_base(0, steps)).state_dict_and_meta(steps=steps)
        runs.mkdir(parents=True, exist_ok=True)
        save_safetensors(tensors, path, meta)
    return path


def curve(run_dir: Path, keys: tuple[str, ...]) -> dict:
    """Eval points (training seconds, iteration, {key: value}) and seconds per iteration of a finished run."""
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    summary = json.loads((run_dir / "summary.json").read_text())
    points, elapsed = [(0.0, 0, {k: summary["eval_before"][k] for k in keys})], 0.0
    for r in rows:
        elapsed += r["seconds"] - r.get("seconds_eval", 0.0)
        if all(f"eval/{k}" in r for k in keys):
            points.append((elapsed, r["iteration"], {k: r[f"eval/{k}"] for k in keys}))
    points.append((elapsed, summary["iterations"], {k: summary["eval_after"][k] for k in keys}))
    nfe = statistics.mean(r["nfe_rollout"] for r in rows) if rows else 0.0
    return {"points": points, "seconds": elapsed, "s_per_iter": elapsed / max(len(rows), 1), "nfe_rollout": nfe}


def at_budget(points: list, budget: float, s_per_iter: float) -> dict:
    """The last evaluation whose iteration fits in `budget` seconds at `s_per_iter` (the method's fastest)."""
    inside = [p for p in points if p[1] * s_per_iter <= budget + 1e-9]
    return inside[-1][2]


def mean_std(xs: list[float]) -> str:
    if len(xs) == 1:
        return f"{xs[0]:.3f}"
    m, s = seed_mean_std(xs)  # the sample standard deviation (common.sample_std)
    return f"{m:.3f} ± {s:.3f}"


def table(title: str, methods: dict, runs: dict, keys: tuple[str, ...], part: str) -> tuple[list[str], list[dict]]:
    """Markdown lines and JSON rows for one part: per method, each key at each budget (mean ± std over seeds)."""
    spi = {m: min(c["s_per_iter"] for c in runs[m]) for m in methods if runs.get(m)}
    its = {m: max(c["points"][-1][1] for c in runs[m]) for m in spi}
    slowest = max(spi[m] * its[m] for m in spi)
    budgets = [f * slowest for f in BUDGET_FRACTIONS]
    head = ["method", "seeds", "s/iter", "rollout NFE"] + [f"{k} @ {b:.0f} s" for b in budgets for k in keys]
    lines = [f"**{title}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = []
    for m in methods:
        cs = runs.get(m)
        if not cs:
            continue
        cells = [m, str(len(cs)), f"{spi[m]:.2f}", f"{statistics.mean(c['nfe_rollout'] for c in cs):.1f}"]
        row = {"part": part, "method": m, "seeds": len(cs), "s_per_iter": spi[m], "budgets_s": budgets,
               "s_per_iter_seeds": [c["s_per_iter"] for c in cs]}
        for b in budgets:
            for k in keys:
                vals = [at_budget(c["points"], b, spi[m])[k] for c in cs]
                cells.append(mean_std(vals))
                row[f"{k}@{b:.0f}s"] = statistics.mean(vals)
                row[f"{k}@{b:.0f}s_std"] = sample_std(vals)
        for k in keys:
            row[f"{k}_before"] = cs[0]["points"][0][2][k]
            row[f"{k}_final"] = statistics.mean(c["points"][-1][2][k] for c in cs)
        lines.append("| " + " | ".join(cells) + " |")
        rows.append(row)
    before = ", ".join(f"{k} {runs[next(iter(runs))][0]['points'][0][2][k]:.3f}" for k in keys)
    lines += ["", f"Base before training: {before}. Final (end of each run, mean over seeds): "
              + "; ".join(f"{r['method']} " + ", ".join(f"{k} {r[f'{k}_final']:.3f}" for k in keys) for r in rows), ""]
    return lines, rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    standard_args(ap, "1 seed, short runs, small evaluations (~2 min)")
    ap.add_argument("--parts", default="sudoku,digit_tokens,erils", help="comma-separated: sudoku, digit_tokens, erils")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--iterations", type=int, default=None, help=f"per run (default: {ITERATIONS}; --quick 6)")
    ap.add_argument("--every", type=int, default=20, help="iterations between evaluations")
    ap.add_argument("--weak-steps", type=int, default=45, help="pretraining steps of the ERILS part's weaker base")
    ap.add_argument("--runs", type=Path, default=ROOT / "runs" / "bench_masked")
    ap.add_argument("--methods", nargs="+", default=None,
                    help="run only these estimator methods (e.g. coupled-GRPO), to split a part over processes; "
                         "the table then has only them (assemble all with --reuse)")
    ap.add_argument("--only-finished", action="store_true",
                    help="train nothing: tabulate the finished runs only (each row says how many seeds it has); a "
                         "partial table, so it never writes BENCHMARKS.md (implies --no-write)")
    ap.add_argument("--reuse", action="store_true", help="skip runs whose run directory holds a finished run of the same config")
    args = ap.parse_args(argv)
    args.no_write |= args.only_finished  # only a run that trains what is missing may publish its table
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in (*WORLDS, "erils")]
    if unknown:
        raise SystemExit(f"bench_masked: unknown part(s) {unknown}; known: {', '.join([*WORLDS, 'erils'])}")
    seeds = args.seeds[:1] if args.quick else args.seeds
    quick = [*([] if args.iterations else ["train.iterations=6"]),  # an explicit --iterations wins over --quick's
             "eval.count=32", "eval.per_digit=5", "rollout.prompts_per_iter=4",
             "train.micro_batch=32", "train.updates_per_epoch=null"] if args.quick else []
    runs_dir = args.runs / ("quick" if args.quick else "full")

    lines, rows = [], []
    for world in [p for p in parts if p in WORLDS]:
        keys = WORLDS[world][1]
        its = [f"train.iterations={args.iterations or ITERATIONS[world]}"]
        runs = {m: [curve(d, keys) for s in seeds
                    if (d := run_one(world, [f"seed={s}", f"eval.every={args.every}", *its, *ov, *quick],
                                     runs_dir / world / f"{m}-s{s}", args.reuse, args.only_finished))]
                for m, ov in ESTIMATORS.items() if args.methods is None or m in args.methods}
        part_lines, part_rows = table(f"Estimators on {world} ({WORLDS[world][0]}, {len(seeds)} seed(s))",
                                      ESTIMATORS, runs, keys, world)
        lines += part_lines
        rows += part_rows
    if "erils" in parts:
        keys = WORLDS["sudoku"][1]
        weak = weak_base(runs_dir, args.weak_steps)
        its = f"train.iterations={args.iterations or ITERATIONS['erils']}"
        runs = {m: [curve(d, keys) for s in seeds
                    if (d := run_one("sudoku", [f"seed={s}", f"eval.every={args.every}", its, f"model.path={weak}", *ov, *quick],
                                     runs_dir / "erils" / f"{m.split(',')[0].replace(' ', '_')}-{len(ov)}-s{s}", args.reuse,
                                     args.only_finished))]
                for m, ov in ERILS.items()}
        part_lines, part_rows = table(f"ERILS vs on-policy only on Sudoku from a weaker base "
                                      f"(pretrain_sudoku.py at {args.weak_steps} steps, {len(seeds)} seed(s))",
                                      ERILS, runs, keys, "erils")
        lines += part_lines
        rows += part_rows
    lines = ["Each run: one process, one thread. s/iter = the fastest seed's training seconds per iteration (evaluations "
             "excluded); a cell 'X @ B s' = the last evaluation (every --every iterations) of each seed whose iteration x "
             "s/iter fits in B seconds, mean ± std over seeds; B = 1/4, 1/2 and all of the slowest method's run. Rollout "
             "NFE counts the external checkpoint's forwards too.", "", *lines]
    publish(args, BEGIN, END, "Masked diffusion: estimators and external rollouts (bench_masked)", "bench_masked.py",
            argv, lines, rows)
    return rows


if __name__ == "__main__":
    main()

"""Flat GRPO (plain, with TempFlow's step weights, trained on steps 0-3) vs BranchGRPO (one tree and a forest per
prompt) vs Sol-RL on the moving-digits video world: cost per iteration and learning at equal wall-clock and at
equal iterations, several seeds, in one run.

    .venv/bin/python benchmarks/bench_video.py --json benchmarks/results/bench_video.json   # full: 3 seeds x 100 iterations (~75 min)
    .venv/bin/python benchmarks/bench_video.py --quick                                       # ~3 min, never writes
    .venv/bin/python benchmarks/bench_video.py --render-from benchmarks/results/bench_video.json   # the block again

Every method starts from the bundled base with configs/moving_digits.yaml (8 prompts x 16 clips per
iteration, flow-SDE a = 1.0, 8 steps, PPO-clip, KL 0.2, LoRA r16, the three video
rewards summed 2 / 1 / 1); only the rollout, the trained steps or their weights differ (--quick: 4 prompts per
iteration, small evaluations):
  flat GRPO   16 independent SDE samples per prompt, 7 trained steps each
  flat GRPO + TempFlow  the same rollout, each step's loss weighted by TempFlow-GRPO's 2.25 std
              (train.step_weight=tempflow, as in the leaf-weighted tree below)
  flat GRPO, steps 0-3  16 independent samples per prompt, SDE and trained on steps 0-3 only, ODE on steps 4-7
              (steps.mode=fixed_window, window_start 0, size 4: where this world decides the direction of motion,
              benchmarks/diag_branch.py); the same rollout NFEs, 4/7 of the trained transitions
  BranchGRPO  one tree per prompt, splits at steps 0, 2, 4, 6 (x2) -> 16 leaves; every SDE edge trained with
              its child's depth-wise advantage (docs/reference/specs/branch-cps-guard.md §1)
  BranchGRPO, leaf weights + TempFlow  one tree per prompt split at steps 0, 1, 2, 3 (x2), where this world
              decides the direction of motion (benchmarks/diag_branch.py), each edge weighted by the leaves below
              it (tree.edge_weight=leaves) and each step by TempFlow-GRPO's 2.25 std (train.step_weight=tempflow),
              the best tree of benchmarks/bench_branch_video.py's ablations
  BranchGRPO forest, steps 0-3  8 trees per prompt (tree.roots=8), each split once at step 4 (x2), trained on
              steps 0-3 only (tree.depth_prune=[5,6,7]; 2 updates per rollout)
  Sol-RL      32 candidate seeds per prompt from an NVFP4 rollout copy in 4 ODE steps, rewarded; the 8 best
              and 8 worst regenerated at full precision and trained with the same GRPO loss
              (docs/reference/specs/lowprec-and-correctors.md §1; the NVFP4 copy is the exact CPU emulation, so it saves
              no time here)

Cost: the median seconds per iteration (evaluations excluded) and the network evaluations per iteration
(rollout + low-precision candidates + update forwards), as ratios to flat GRPO's, from the learning runs
themselves. Learning at equal wall-clock: the budget is flat GRPO's mean training seconds over its
iterations; a method that has not spent it after the same iterations is resumed (`resume=`, the same run
continued exactly) to the first evaluation past it, and each run is read at its last evaluation inside the
budget of its own cumulative training seconds (all runs in this one process, one thread each, one after the
other: a busy machine slows all of them, not one). Learning at equal iterations: the evaluation after
`--iterations`; for Sol-RL that is also equal full-precision rollout NFE (its trained group is
regenerated at full precision, 16 per prompt like flat GRPO's; the pool is low precision).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import at_budget as common_at_budget  # noqa: E402
from common import SPREAD_NOTE, beyond_spread, budget_run, publish, republish, sample_std  # noqa: E402
from common import standard_args, train_seconds  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- bench_video:start -->", "<!-- bench_video:end -->"
TITLE = "Video: flat GRPO (plain, TempFlow, steps 0-3) vs BranchGRPO vs Sol-RL (moving-digits world)"
CONFIG = ROOT / "configs" / "moving_digits.yaml"
METHODS = {
    "flat GRPO": [],
    "flat GRPO + TempFlow": ["train.step_weight=tempflow"],
    "flat GRPO, steps 0-3": ["steps.mode=fixed_window", "steps.window_start=0", "steps.window_size=4"],
    "BranchGRPO": ["rollout.kind=tree", "tree.split_steps=[0,2,4,6]", "tree.factor=2"],
    "BranchGRPO, leaf weights + TempFlow": ["rollout.kind=tree", "tree.split_steps=[0,1,2,3]", "tree.factor=2",
                                           "tree.edge_weight=leaves", "train.step_weight=tempflow"],
    "BranchGRPO forest, steps 0-3": ["rollout.kind=tree", "tree.split_steps=[4]", "tree.factor=2", "tree.roots=8",
                                     "tree.depth_prune=[5,6,7]", "train.micro_batch=64", "train.updates_per_epoch=null"],
    "Sol-RL": ["rollout.kind=solrl", "rollout.precision=nvfp4", "solrl.candidates=32", "solrl.preview_steps=4",
               "solrl.select=best_worst"],
}
METRICS = ("accuracy", "motion_accuracy", "fd", "judge_accuracy", "judge_motion_accuracy")


def nfe(r: dict) -> int:
    return r.get("nfe_full", 0) + r.get("nfe_lowprec", 0) + r["nfe_train"]


def one_run(name: str, seed: int, iterations: int, every: int, out: Path, extra: list[str],
            budget: float | None = None) -> dict:
    """`iterations` of method `name`; then, if `budget` (flat GRPO's training seconds) is not spent, the same run
    resumed to the first evaluation past it (common.budget_run), so a cheaper method gets flat GRPO's wall-clock."""
    overrides = [*METHODS[name], f"seed={seed}", f"train.iterations={iterations}", f"eval.every={every}", "threads=1",
                 *extra]
    return budget_run(CONFIG, overrides, out / name.replace(" ", "_") / f"seed{seed}", iterations, every, METRICS,
                      budget)


def at_budget(run: dict, budget: float) -> dict:
    """The last evaluation (before, every `every`, at the end) within `budget` cumulative training seconds."""
    return common_at_budget(run, budget, METRICS)


def spread_sentence(name: str, key: str, rows: dict, higher_is_better: bool) -> str:
    """`name` vs flat GRPO on `key` at the budget: better / worse only beyond both spreads (mean +- std)."""
    a, b = rows[name], rows["flat GRPO"]
    ma, sa, mb, sb = a[f"{key}_mean"], a[f"{key}_std"], b[f"{key}_mean"], b[f"{key}_std"]
    gap = ma - mb if higher_is_better else mb - ma
    if len(a["seeds"]) < 2:
        return (f"- {name}: {key} at equal wall-clock {ma:.3f} vs flat GRPO's {mb:.3f} (one seed: no spread over "
                "seeds, so no better / worse claim)")
    if not beyond_spread(ma, sa, mb, sb):
        verdict = f"within the spread over seeds of flat GRPO's ({ma:.3f} ± {sa:.3f} vs {mb:.3f} ± {sb:.3f})"
    else:
        verdict = (f"{'better' if gap > 0 else 'worse'} than flat GRPO's beyond the spread over seeds "
                   f"({ma:.3f} ± {sa:.3f} vs {mb:.3f} ± {sb:.3f})")
    return f"- {name}: {key} at equal wall-clock is {verdict}."


def final_sentence(name: str, key: str, rows: dict) -> str:
    """`name` vs flat GRPO on `key` after the same iterations (final evaluation, mean +- std over seeds)."""
    a, b = rows[name], rows["flat GRPO"]
    ma, sa, mb, sb = a[f"{key}_final"], a[f"{key}_final_std"], b[f"{key}_final"], b[f"{key}_final_std"]
    if len(a["seeds"]) < 2:
        return f"- {name}: {key} after {a['iterations']} iterations {ma:.3f} vs flat GRPO's {mb:.3f} (one seed: no claim)"
    how = ("within the spread over seeds of" if not beyond_spread(ma, sa, mb, sb) else
           f"{'better' if ma > mb else 'worse'} beyond the spread over seeds than")
    return (f"- {name}: {key} after the same {a['iterations']} iterations is {how} flat GRPO's ({ma:.3f} ± {sa:.3f} vs "
            f"{mb:.3f} ± {sb:.3f}).")


def load_sentence(rows: dict, tolerance: float = 1.25) -> str:
    """Whether the machine's load held still: equal wall-clock assumes a busy machine slows every run alike, which
    fails when the load changes during the run (the runs are one after the other). The same method's seeds do the
    same work per iteration, so a per-seed median seconds per iteration more than `tolerance` times another's
    says the load changed."""
    moved = {n: r["seconds_per_iter_per_seed"] for n, r in rows.items()
             if len(r["seconds_per_iter_per_seed"]) > 1
             and max(r["seconds_per_iter_per_seed"]) > tolerance * min(r["seconds_per_iter_per_seed"])}
    if not moved:
        return (f"Load check: every method's per-seed median seconds per iteration are within {tolerance:g}x of each "
                "other: no method's seeds saw the load move that far.")
    return ("Load check: the machine's load changed during the run, so the equal wall-clock columns (iterations, "
            "accuracy, motion accuracy, FD and judge at budget) and the seconds ratios do not compare the methods; "
            "the columns at equal iterations and the NFE ratios do. Per-seed median seconds per iteration more than "
            f"{tolerance:g}x apart: " + "; ".join(f"{n} {', '.join(f'{x:.2f}' for x in xs)}" for n, xs in moved.items())
            + ".")


def drift_sentence(rows: dict) -> str:
    """How far the seconds columns move for the same work: flat GRPO + TempFlow does flat GRPO's work per iteration
    (the same rollout NFEs and trained transitions; its step weight is one multiply per transition), so its seconds
    ratio to flat GRPO is the machine's drift between two runs of equal work. "" when the run lacks that pair."""
    a, b = rows.get("flat GRPO + TempFlow"), rows["flat GRPO"]
    if a is None or a["nfe_per_iter"] != b["nfe_per_iter"]:
        return ""
    ratio = a["seconds_per_iter"] / b["seconds_per_iter"]
    return (f"Drift: flat GRPO + TempFlow does flat GRPO's work per iteration (the same {a['nfe_per_iter']:.0f} NFEs "
            "and trained transitions; its step weight is one multiply per transition) and ran at "
            f"{ratio:.2f}× its seconds per iteration: on this run a seconds ratio that close to 1 does not tell two "
            "methods' costs apart; the NFE ratios do.")


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    standard_args(ap, "one seed, 6 iterations, small evaluations (~3 min)")
    ap.add_argument("--seeds", type=int, nargs="+", help="training seeds (default 0 1 2; --quick 0)")
    ap.add_argument("--iterations", type=int, help="iterations of every run (default 100, a quarter of the config's "
                    "400: 7 methods x 3 seeds in about 75 minutes; --quick 6)")
    ap.add_argument("--every", type=int, help="evaluation interval (default 10; --quick 3)")
    ap.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_video")
    ap.add_argument("--render-from", type=Path, help="re-render the published block from a full run's saved rows "
                    "(its --json) instead of running")
    args = ap.parse_args(argv)
    if args.render_from:
        rows = json.loads(args.render_from.read_text())
        # rows saved before they carried `every` come from a full run at its default (10) unless --every says
        every = rows[0].get("every", args.every or 10)
        republish(BEGIN, END, render({r["method"]: r for r in rows}, rows[0]["iterations"], every, rows[0]["seeds"]),
                  args.render_from, "bench_video.py")
        return rows
    q = args.quick
    seeds = args.seeds or ([0] if q else [0, 1, 2])
    iterations = args.iterations or (6 if q else 100)
    every = args.every or (3 if q else 10)
    extra = ["rollout.prompts_per_iter=4", "eval.per_digit=2", "eval.num_steps=6"] if q else []
    methods = ["flat GRPO", *[m for m in args.methods if m != "flat GRPO"]]

    runs = {"flat GRPO": [one_run("flat GRPO", s, iterations, every, args.out, extra) for s in seeds]}
    budget = statistics.mean(sum(train_seconds(r) for r in run["rows"]) for run in runs["flat GRPO"])
    runs |= {name: [one_run(name, s, iterations, every, args.out, extra, budget) for s in seeds] for name in methods[1:]}
    table = {}
    for name, rs in runs.items():
        per_iter = statistics.median(train_seconds(r) for run in rs for r in run["rows"])
        nfe_iter = statistics.median(nfe(r) for run in rs for r in run["rows"])
        eq = [at_budget(run, budget) for run in rs]
        row = {"method": name, "overrides": METHODS[name], "seeds": seeds, "iterations": iterations, "seconds_per_iter": per_iter,
               "nfe_per_iter": nfe_iter, "budget_seconds": budget,
               "iterations_at_budget": statistics.mean(e["iteration"] for e in eq),
               "iterations_run": [run["iterations"] for run in rs],
               "seconds_at_budget": [e["seconds"] for e in eq],
               "seconds_per_iter_per_seed": [statistics.median(train_seconds(r) for r in run["rows"]) for run in rs]}
        for k in METRICS:
            row[f"{k}_mean"] = statistics.mean(e[k] for e in eq)
            row[f"{k}_std"] = sample_std(e[k] for e in eq)
            row[f"{k}_before"] = rs[0]["summary"]["eval_before"][k]
            row[f"{k}_final"] = statistics.mean(run["summary"]["eval_after"][k] for run in rs)
            row[f"{k}_final_std"] = sample_std(run["summary"]["eval_after"][k] for run in rs)
        table[name] = row
    flat = table["flat GRPO"]
    for row in table.values():
        row["seconds_ratio"] = row["seconds_per_iter"] / flat["seconds_per_iter"]
        row["nfe_ratio"] = row["nfe_per_iter"] / flat["nfe_per_iter"]

    for row in table.values():
        row["every"] = every  # what --render-from needs besides the table
    rows = list(table.values())
    publish(args, BEGIN, END, TITLE, "bench_video.py", argv, render(table, iterations, every, seeds), rows)
    return rows


def render(table: dict, iterations: int, every: int, seeds: list[int]) -> list[str]:
    """The block's lines from the rows by method (a run's, or saved ones: --render-from)."""
    flat = table["flat GRPO"]
    budget = flat["budget_seconds"]
    lines = [f"Moving-digits world (configs/moving_digits.yaml), {iterations} iterations per run, seeds {seeds} (n={len(seeds)}), "
             f"evaluation every {every}; budget = flat GRPO's {budget:.0f} s of training (mean over seeds of its {iterations} "
             "iterations). A method cheaper per iteration is resumed past them (`resume=`, exact) until an evaluation "
             "past the budget, and read at its last evaluation inside it. "
             f"Base: accuracy {flat['accuracy_before']:.3f}, motion accuracy {flat['motion_accuracy_before']:.3f}, "
             f"FD {flat['fd_before']:.1f}, the held-out judge's motion {flat['judge_motion_accuracy_before']:.3f} (block "
             "matching between frames, which training never sees). " + SPREAD_NOTE, "",
             "| method | s / iter | × flat | NFE / iter | × flat | iterations at budget | accuracy at budget | "
             f"motion accuracy at budget | FD at budget | judge (frames / motion) at budget | accuracy at {iterations} "
             f"iterations | motion accuracy at {iterations} iterations |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in table.values():
        lines.append(f"| {r['method']} | {r['seconds_per_iter']:.2f} | {r['seconds_ratio']:.2f}× | {r['nfe_per_iter']:.0f} | "
                     f"{r['nfe_ratio']:.2f}× | {r['iterations_at_budget']:.0f} | {r['accuracy_mean']:.3f} ± "
                     f"{r['accuracy_std']:.3f} | {r['motion_accuracy_mean']:.3f} ± {r['motion_accuracy_std']:.3f} | "
                     f"{r['fd_mean']:.1f} ± {r['fd_std']:.1f} | {r['judge_accuracy_mean']:.3f} / "
                     f"{r['judge_motion_accuracy_mean']:.3f} | {r['accuracy_final']:.3f} ± {r['accuracy_final_std']:.3f} | "
                     f"{r['motion_accuracy_final']:.3f} ± {r['motion_accuracy_final_std']:.3f} |")
    lines.append("")
    for name in table:
        if name != "flat GRPO":
            lines += [spread_sentence(name, "accuracy", table, True), spread_sentence(name, "motion_accuracy", table, True),
                      spread_sentence(name, "judge_motion_accuracy", table, True),
                      final_sentence(name, "motion_accuracy", table)]
    drift = drift_sentence(table)
    lines += ["", load_sentence(table), *(["", drift] if drift else []), "",
              "'iterations at budget' 0 means the base: the method's first evaluation came after flat GRPO's budget. "
              "Iterations run per seed: " + "; ".join(f"{n} {', '.join(map(str, r['iterations_run']))}"
                                                      for n, r in table.items()) + ".",
              "", "CPU only (no GPU used); seconds are single-thread timings of the runs one after another on a "
              "machine that may have been shared. The NVFP4 rollout copy is an exact emulation on the CPU "
              "(slower than fp32 there): Sol-RL's candidate stage saves no time on this machine."]
    return lines


if __name__ == "__main__":
    main()

"""BranchGRPO on the moving-digits video world: why it learns motion slowly, and ablations at equal iterations.

    .venv/bin/python benchmarks/bench_branch_video.py --json benchmarks/results/bench_branch_video.json  # ~60 min alone (1 thread)
    .venv/bin/python benchmarks/bench_branch_video.py --quick                                             # ~3 min, never writes
    # the same runs in two processes (2 cores), then the table from their run directories:
    .venv/bin/python benchmarks/bench_branch_video.py --variants "flat GRPO" ... --no-write &
    .venv/bin/python benchmarks/bench_branch_video.py --reuse --json benchmarks/results/bench_branch_video.json

Part 1 is benchmarks/diag_branch.py on the base policy (where the direction of motion is decided in the
8-step sampler, and how many trained records per prompt can carry it). Part 2 trains each variant of
configs/moving_digits.yaml (8 prompts x 16 clips per iteration) for the same number of iterations and seeds
and evaluates it at the midpoint and the end (200 clips). Variants (VARIANTS): flat GRPO, the BranchGRPO of
benchmarks/bench_video.py (splits 0, 2, 4, 6 x2: one tree per prompt), splits where motion is decided
(0, 1, 2, 3), a wider first split (factor 4 at 0, 2), the paper's split noise kappa = 4, forests
(`tree.roots`: several trees per prompt, each its own initial noise, advantages normalised per prompt and depth),
depth pruning of the steps after the direction of motion is decided (child depths 5-7 = steps 4-6, BranchGRPO's
DepPru placed by part 1), flat GRPO trained on steps 0-3 only (a fixed MixGRPO-style window), edges weighted by
the leaves below them (`tree.edge_weight=leaves`) on four of those schedules, the reward fusion of internal
nodes (path-probability, soft), no KL, TempFlow-GRPO's per-step weight (`train.step_weight=tempflow`, against
part 1's late-step dominance) on the tree, on flat GRPO and with leaf weights, and a tree trained on steps 0-3.
--reuse takes a run whose run directory already holds summary.json for the same overrides.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SPREAD_NOTE, beyond_spread, mean_std, publish, standard_args  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- bench_branch_video:start -->", "<!-- bench_branch_video:end -->"
CONFIG = ROOT / "configs" / "moving_digits.yaml"
TREE = ["rollout.kind=tree", "tree.factor=2"]
VARIANTS = {
    "flat GRPO": [],
    "BranchGRPO 0,2,4,6 x2": [*TREE, "tree.split_steps=[0,2,4,6]"],
    "splits 0,1,2,3 x2": [*TREE, "tree.split_steps=[0,1,2,3]"],
    "splits 0,2 x4": ["rollout.kind=tree", "tree.split_steps=[0,2]", "tree.factor=4"],
    "kappa 4 (0,2,4,6 x2)": [*TREE, "tree.split_steps=[0,2,4,6]", "tree.noise_scale=4.0"],
    "forest 4 roots, splits 2,4 x2": [*TREE, "tree.split_steps=[2,4]", "tree.roots=4"],
    "forest 8 roots, split 4 x2": [*TREE, "tree.split_steps=[4]", "tree.roots=8"],
    # pruned: micro-batches sized on the kept edges (12 / 32 per tree or forest x 8 prompts), so that they too
    # make 2 updates per rollout (set by hand when auto sized on the edges before pruning; auto now sizes on the
    # kept edges and chooses the same 24 / 64, so these commands keep the recorded runs' numbers)
    "depth prune 5,6,7 (0,2,4,6 x2)": [*TREE, "tree.split_steps=[0,2,4,6]", "tree.depth_prune=[5,6,7]",
                                       "train.micro_batch=24", "train.updates_per_epoch=null"],
    "forest 8, depth prune 5,6,7": [*TREE, "tree.split_steps=[4]", "tree.roots=8", "tree.depth_prune=[5,6,7]",
                                    "train.micro_batch=64", "train.updates_per_epoch=null"],
    "flat, window steps 0-3": ["steps.mode=fixed_window", "steps.window_start=0", "steps.window_size=4"],
    # tree.edge_weight=leaves: each edge's loss and KL weighted by the leaves below it, so the shared early steps
    # weigh in the update as flat GRPO's 16 samples do there (difrl.algos.tree.edge_leaf_weights)
    "leaf weights (0,2,4,6 x2)": [*TREE, "tree.split_steps=[0,2,4,6]", "tree.edge_weight=leaves"],
    "leaf weights, splits 0,1,2,3 x2": [*TREE, "tree.split_steps=[0,1,2,3]", "tree.edge_weight=leaves"],
    "leaf weights, splits 0,2 x4": ["rollout.kind=tree", "tree.split_steps=[0,2]", "tree.factor=4", "tree.edge_weight=leaves"],
    "leaf weights, forest 8, split 4": [*TREE, "tree.split_steps=[4]", "tree.roots=8", "tree.edge_weight=leaves"],
    # reward fusion of internal nodes (docs/reference/specs/branch-cps-guard.md §1.3): the paper's path-probability
    # weighting and a log-mean-exp (DTS's soft value, §5) instead of the mean
    "path-prob fusion (0,2,4,6 x2)": [*TREE, "tree.split_steps=[0,2,4,6]", "tree.fusion=path_prob"],
    "soft fusion (0,2,4,6 x2)": [*TREE, "tree.split_steps=[0,2,4,6]", "tree.fusion=soft"],
    # the KL to the base on shared edges (BranchGRPO's reference code has none)
    "KL 0 (0,2,4,6 x2)": [*TREE, "tree.split_steps=[0,2,4,6]", "train.kl_beta=0"],
    # part 1: the low-noise late steps (small std, large score) set the update's direction; TempFlow-GRPO's
    # noise-aware weight (2.25 std per step, docs/reference/specs/branch-cps-guard.md §4) rebalances the steps, for both
    # rollouts
    "TempFlow weights (0,2,4,6 x2)": [*TREE, "tree.split_steps=[0,2,4,6]", "train.step_weight=tempflow"],
    "flat, TempFlow weights": ["train.step_weight=tempflow"],
    "leaf weights + TempFlow, splits 0,1,2,3 x2": [*TREE, "tree.split_steps=[0,1,2,3]", "tree.edge_weight=leaves",
                                                  "train.step_weight=tempflow"],
    "leaf weights + TempFlow, splits 0,2 x4": ["rollout.kind=tree", "tree.split_steps=[0,2]", "tree.factor=4",
                                               "tree.edge_weight=leaves", "train.step_weight=tempflow"],
    "leaf weights + TempFlow, forest 8, split 4": [*TREE, "tree.split_steps=[4]", "tree.roots=8",
                                                   "tree.edge_weight=leaves", "train.step_weight=tempflow"],
    # the tree counterpart of "flat, window steps 0-3": every split where motion is decided, steps 4-6 untrained
    # (2 + 4 + 8 + 16 = 30 kept edges per tree x 8 prompts = 240: micro-batches of 60 for 2 updates)
    "leaf weights, splits 0,1,2,3 x2, steps 0-3": [*TREE, "tree.split_steps=[0,1,2,3]", "tree.edge_weight=leaves",
                                                   "tree.depth_prune=[5,6,7]", "train.micro_batch=60",
                                                   "train.updates_per_epoch=null"],
}
BASELINE = "BranchGRPO 0,2,4,6 x2"
# a tree variant that changes the loss (step weights) or the trained steps is also held against flat GRPO with the
# same change, so that a gain the option gives flat GRPO too is not read as the tree catching up
FLAT_COUNTERPART = {
    "TempFlow weights (0,2,4,6 x2)": "flat, TempFlow weights",
    "leaf weights + TempFlow, splits 0,1,2,3 x2": "flat, TempFlow weights",
    "leaf weights + TempFlow, splits 0,2 x4": "flat, TempFlow weights",
    "leaf weights + TempFlow, forest 8, split 4": "flat, TempFlow weights",
    "leaf weights, splits 0,1,2,3 x2, steps 0-3": "flat, window steps 0-3",
    "forest 8, depth prune 5,6,7": "flat, window steps 0-3",
}
METRICS = ("accuracy", "motion_accuracy", "fd")


def train_seconds(r: dict) -> float:
    return r["seconds"] - r.get("seconds_eval", 0.0)


def one_run(name: str, seed: int, iterations: int, every: int, out: Path, extra: list[str], reuse: bool):
    overrides = [*VARIANTS[name], f"seed={seed}", f"train.iterations={iterations}", f"eval.every={every}", "threads=1",
                 *extra]
    d = out / name.replace(" ", "_").replace(",", "-") / f"seed{seed}"
    done = d / "summary.json"
    if not (reuse and done.exists() and json.loads((d / "overrides.json").read_text()) == overrides):
        from difrl.train.config import load_flow_config
        from difrl.train.flow.trainer import train

        train(load_flow_config(CONFIG, overrides), out_dir=d, overwrite=True)
        (d / "overrides.json").write_text(json.dumps(overrides))
    rows = [json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return rows, json.loads(done.read_text())


def verdict(a: dict, b: dict, key: str, names: tuple[str, str]) -> str:
    """`a` vs `b` on key (mean, sample std over seeds): above / below only beyond the spread (common.beyond_spread)."""
    (ma, sa), (mb, sb) = a[key], b[key]
    if len(a["seeds"]) < 2:
        return f"{names[0]} {ma:.3f} vs {names[1]} {mb:.3f} (one seed: no claim)"
    if not beyond_spread(ma, sa, mb, sb):
        return f"within the seed spread of {names[1]} ({ma:.3f} ± {sa:.3f} vs {mb:.3f} ± {sb:.3f})"
    return f"{'above' if ma > mb else 'below'} {names[1]} beyond the seed spread ({ma:.3f} ± {sa:.3f} vs {mb:.3f} ± {sb:.3f})"


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    standard_args(ap, "seed 0, 3 variants, 6 iterations, small evaluations (~3 min)")
    ap.add_argument("--seeds", type=int, nargs="+", help="training seeds (default 0 1 2; --quick 0)")
    ap.add_argument("--iterations", type=int, help="iterations per run (default 60; --quick 6)")
    ap.add_argument("--every", type=int, help="evaluation interval (default 30: the midpoint; --quick 3)")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), help="default all (--quick: flat, baseline, forest 8)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_branch_video")
    ap.add_argument("--reuse", action="store_true", help="take finished runs with the same overrides from --out")
    ap.add_argument("--no-diag", action="store_true", help="skip part 1 (benchmarks/diag_branch.py)")
    ap.add_argument("--diag-json", type=Path, help="part 1 from this `diag_branch.py --json` file instead of running it")
    args = ap.parse_args(argv)
    q = args.quick
    seeds = args.seeds or ([0] if q else [0, 1, 2])
    iterations = args.iterations or (6 if q else 60)
    every = args.every or (3 if q else 30)
    names = args.variants or (["flat GRPO", BASELINE, "forest 8 roots, split 4 x2"] if q else list(VARIANTS))
    extra = ["rollout.prompts_per_iter=4", "eval.per_digit=2", "eval.num_steps=6"] if q else []

    lines = []
    diag = None
    if not args.no_diag:
        import diag_branch

        if args.diag_json:  # JSON keys are strings: back to step indices
            diag = json.loads(args.diag_json.read_text())
            for k in ("tree", "flat", "grad_norm_tree", "grad_norm_flat"):
                diag[k] = {int(i): v for i, v in diag[k].items()}
        else:
            diag = diag_branch.main(["--quick"] if q else [])
        dec = diag["decided_share_after_shared_steps"]
        lines += ["**Part 1: where motion is decided** (`benchmarks/diag_branch.py`, base policy, "
                  f"{diag['prompts']} trees of 16 continuations). Share of the motion outcome's variance fixed by "
                  "the first s sampler steps (s = 0: the initial noise alone): "
                  + ", ".join(f"s={s}: {d:.2f}" for s, d in enumerate(dec)) + ".", "",
                  "| step | records / prompt: tree / flat | corr(advantage, motion): tree / flat | kernel std: tree / "
                  "flat | grad norm of the step's records: tree / flat |", "|---:|---:|---:|---:|---:|"]
        for i, t in diag["tree"].items():
            f = diag["flat"].get(i) or diag["flat"].get(str(i))
            gt = diag["grad_norm_tree"].get(i, diag["grad_norm_tree"].get(str(i)))
            gf = diag["grad_norm_flat"].get(i, diag["grad_norm_flat"].get(str(i)))
            lines.append(f"| {i} | {t['records_per_prompt']:.0f} / {f['records_per_prompt']:.0f} | "
                         f"{t['corr_adv_motion']:.2f} / {f['corr_adv_motion']:.2f} | {t['std']:.3f} / {f['std']:.3f} | "
                         f"{gt:.2g} / {gf:.2g} |")
        mi = diag["motion_informative_records_per_prompt"]
        opened = diag["open_steps"]
        diag["open_records_per_prompt"] = {k: sum(diag[k][i]["records_per_prompt"] for i in opened) for k in ("tree", "flat")}
        diag["informative_ratio"] = mi["flat"] / max(mi["tree"], 1e-9)
        lines += ["", f"The motion outcome is still open (less than 90% fixed) before steps {opened}. There a tree of "
                  f"splits {diag['splits']} x{diag['factor']} trains {diag['open_records_per_prompt']['tree']:.0f}"
                  f" records per prompt, flat GRPO {diag['open_records_per_prompt']['flat']:.0f}; counting "
                  f"only groups whose motion varies: {mi['tree']:.1f} vs {mi['flat']:.1f} motion-informative records "
                  f"per prompt ({diag['informative_ratio']:.1f}x); those steps hold "
                  f"{diag['share_of_records_at_open_steps']['tree']:.0%} of the tree's trained records and "
                  f"{diag['share_of_records_at_open_steps']['flat']:.0%} of flat GRPO's, and their summed policy gradient is "
                  f"{diag['gradient_from_open_steps']['tree']['norm_ratio']:.3f} of the norm of the tree's whole update "
                  f"(cosine {diag['gradient_from_open_steps']['tree']['cosine']:.2f}) against "
                  f"{diag['gradient_from_open_steps']['flat']['norm_ratio']:.3f} of flat GRPO's (cosine "
                  f"{diag['gradient_from_open_steps']['flat']['cosine']:.2f}): the late steps, with a small std and so a "
                  "large score, set the direction of the update (Adam then scales every direction alike). The kernel's std on every step is the "
                  "same (same kernel, kappa 1).", ""]

    runs = {n: [] for n in names}
    for s in seeds:  # seed-major: an interrupted run leaves whole seeds of every variant (--reuse resumes)
        for n in names:
            runs[n].append(one_run(n, s, iterations, every, args.out, extra, args.reuse))
    table = {}
    for name, rs in runs.items():
        row = {"variant": name, "overrides": VARIANTS[name], "seeds": seeds, "iterations": iterations,
               "seconds_per_iter": statistics.median(train_seconds(r) for rows, _ in rs for r in rows),
               "nfe_per_iter": statistics.median(r.get("nfe_full", 0) + r["nfe_train"] for rows, _ in rs for r in rows),
               "records_per_iter": statistics.median(r.get("tree/edges_trained", r["nfe_train"]) for rows, _ in rs
                                                     for r in rows)}
        for k in METRICS:
            row[k] = mean_std([s["eval_after"][k] for _, s in rs])
            mids = [r[f"eval/{k}"] for rows, _ in rs for r in rows if f"eval/{k}" in r and r["iteration"] == every]
            row[f"{k}_mid"] = mean_std(mids) if mids else (float("nan"), 0.0)
            row[f"{k}_before"] = rs[0][1]["eval_before"][k]
        table[name] = row
    spans = {n: [statistics.median(train_seconds(r) for r in rows) for rows, _ in rs] for n, rs in runs.items()}
    flat = table.get("flat GRPO")
    base = table.get(BASELINE)
    for name, row in table.items():  # every figure of the block is in the JSON rows (scripts/check_claims.py)
        row["seconds_per_iter_by_seed"] = spans[name]
        if flat:
            row["nfe_ratio"] = row["nfe_per_iter"] / flat["nfe_per_iter"]
    lines += [f"**Part 2: ablations** (configs/moving_digits.yaml, {iterations} iterations, seeds {seeds} (n={len(seeds)}), "
              f"evaluated at {every} and {iterations}; mean ± sample std over seeds). Base: motion accuracy "
              f"{next(iter(table.values()))['motion_accuracy_before']:.3f}, accuracy "
              f"{next(iter(table.values()))['accuracy_before']:.3f}. " + SPREAD_NOTE, "",
              "| variant | overrides | NFE / iter | × flat | trained records / iter | motion accuracy at "
              f"{every} | motion accuracy at {iterations} | accuracy at {iterations} | FD at {iterations} |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in table.values():
        ratio = f"{r['nfe_per_iter'] / flat['nfe_per_iter']:.2f}×" if flat else "-"
        lines.append(f"| {r['variant']} | `{' '.join(r['overrides']) or '(config)'}` | {r['nfe_per_iter']:.0f} | "
                     f"{ratio} | {r['records_per_iter']:.0f} | "
                     f"{r['motion_accuracy_mid'][0]:.3f} ± {r['motion_accuracy_mid'][1]:.3f} | "
                     f"{r['motion_accuracy'][0]:.3f} ± {r['motion_accuracy'][1]:.3f} | "
                     f"{r['accuracy'][0]:.3f} ± {r['accuracy'][1]:.3f} | {r['fd'][0]:.1f} ± {r['fd'][1]:.1f} |")
    lines.append("")
    for name, r in table.items():
        parts = []
        if base and name not in (BASELINE, "flat GRPO"):
            parts.append("motion accuracy at the end is " + verdict(r, base, "motion_accuracy", (name, "BranchGRPO")))
        if flat and name != "flat GRPO":
            parts.append(("motion accuracy " if not parts else "") + verdict(r, flat, "motion_accuracy", (name, "flat GRPO"))
                         + f"; accuracy (the digit) {verdict(r, flat, 'accuracy', (name, 'flat GRPO'))}, at "
                         f"{r['nfe_per_iter'] / flat['nfe_per_iter']:.2f}× its NFE per iteration")
        if (pair := FLAT_COUNTERPART.get(name)) in table:
            parts.append(f"against {pair}: motion accuracy {verdict(r, table[pair], 'motion_accuracy', (name, pair))}, "
                         f"accuracy {verdict(r, table[pair], 'accuracy', (name, pair))}, at "
                         f"{r['nfe_per_iter'] / table[pair]['nfe_per_iter']:.2f}× its NFE per iteration")
        if parts:
            lines.append(f"- {name}: " + "; ".join(parts) + ".")
    lines += ["", "NFE = network evaluations per iteration (rollout + the trained records' forwards). CPU only (no GPU "
              "used), one thread per run. Seconds are in the JSON rows but not compared: the shared machine's load "
              "changed while these runs ran (median seconds per iteration of one variant's seeds: "
              + "; ".join(f"{n} {min(m):.1f}-{max(m):.1f}" for n, m in spans.items()) + ")."]
    if args.reuse:
        lines.append("The runs were made by this script (`--variants` subsets, two processes at a time, `--no-write`); "
                     "this command read them back (`--reuse` takes a run only if its recorded overrides match)"
                     + (f" and part 1 from `{args.diag_json.as_posix()}` (`benchmarks/diag_branch.py --json`)."
                        if args.diag_json else "."))
    rows = list(table.values())
    if diag is not None:
        rows.append({"diagnosis": diag})
    publish(args, BEGIN, END, "BranchGRPO on moving digits: where motion is decided, and ablations",
            "bench_branch_video.py", argv, lines, rows)
    return rows


if __name__ == "__main__":
    main()

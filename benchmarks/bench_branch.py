"""BranchGRPO tree rollouts against flat GRPO on the digits world: cost per iteration, and learning at
equal wall-clock.

    .venv/bin/python benchmarks/bench_branch.py --json benchmarks/results/bench_branch.json   # ~20 min on 2 cores
    .venv/bin/python benchmarks/bench_branch.py --quick --no-write                             # ~2 min

Every method trains 10 prompts x 16 samples per iteration from the same base, kernel (flow_sde, a=0.7),
10 steps, PPO-clip and KL as the demo (configs/digits.yaml), and makes 2 optimizer updates per iteration
in micro-batches of <= 144 transitions (the flat demo's 16 samples x 9 steps):
  flat GRPO        configs/digits.yaml: 16 independent SDE samples per prompt, 9 trained steps each
  BranchGRPO       configs/digits_branch.yaml: one tree per prompt, splits at 0, 2, 4, 6 -> 16 leaves;
                   every SDE edge trained with its child's depth-wise advantage (mean fusion)
  BranchGRPO-DepPru  + tree.depth_prune=[8,9] (the tail depths' edges skip the backward pass)
  BranchGRPO-WidPru  + tree.width_prune=per_branch (best 1 of each leaf chain's 2 tail edges)
  BranchGRPO-Mix   + steps.mode=fixed_window, window 2: SDE only in steps 0-1 and at the splits, ODE elsewhere

(a) Cost: a calibration run of each method (same invocation, one after the other, evaluation time
excluded) gives the median seconds per iteration, their ratio to flat's, and the network evaluations
per iteration of the rollout (pi_old) and of the update (pi_theta). The bundled generator is so small
that a forward of 10 rows costs a third of one of 160 (per-call overhead), so seconds follow NFEs only
loosely; the same calibration on a randomly initialised generator of width --wide-hidden (compute-bound,
like a real model) shows how the savings scale. Goals: BranchGRPO <= 0.5x flat's seconds per
iteration, Mix <= 0.25x.
(b) Learning at equal wall-clock, several seeds: flat GRPO runs --iterations, the tree methods 2.5x as
many. A method's budget is flat's iterations x (flat's s/iter / its s/iter) from the calibration (a),
so a busy machine during one run does not move it; accuracy and FD are read at the last evaluation
(every --every iterations) inside that budget. The runs' own cumulative training seconds there are
reported too, and the final eval of each run. The FD stopping rule is off.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SPREAD_NOTE, publish, sample_std, same_config, standard_args  # noqa: E402

from difrl.train.config import load_flow_config  # noqa: E402
from difrl.train.flow.trainer import train  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- bench_branch:start -->", "<!-- bench_branch:end -->"
METHODS = {
    "flat GRPO": ("digits.yaml", []),
    "BranchGRPO": ("digits_branch.yaml", []),
    "BranchGRPO-DepPru": ("digits_branch.yaml", ["tree.depth_prune=[8,9]"]),
    "BranchGRPO-WidPru": ("digits_branch.yaml", ["tree.width_prune=per_branch"]),
    "BranchGRPO-Mix": ("digits_branch.yaml", ["steps.mode=fixed_window", "steps.window_start=0", "steps.window_size=2"]),
}
TREE_RUN_FACTOR = 2.5  # tree methods run 2.5x flat's iterations: more than any of them fits in flat's time
MAX_MICRO = 144  # transitions per forward/backward: the flat demo's 16 samples x 9 steps
UPDATES = 2  # optimizer updates per iteration, as the flat demo (160 samples / (16 x 5))


def method_config(name: str, overrides: list[str]):
    """The method's config with its micro-batching set for 2 updates per iteration of <= 144 records each
    (tree edges are records of one step; the number of edges after pruning comes from a 1-iteration probe
    of the structure, not of the model)."""
    config, extra = METHODS[name]
    cfg = load_flow_config(ROOT / "configs" / config, [*extra, *overrides])
    if cfg.rollout.kind != "tree":
        return cfg
    edges = trained_edges_per_iteration(cfg)
    grad_accum = math.ceil(edges / UPDATES / MAX_MICRO)
    micro = math.ceil(edges / UPDATES / grad_accum)
    return load_flow_config(ROOT / "configs" / config, [*extra, *overrides, f"train.micro_batch={micro}",
                                                        f"train.grad_accum={grad_accum}"])


def trained_edges_per_iteration(cfg) -> int:
    """Edges that reach the backward pass per iteration (pruning included), from the tree structure alone."""
    from difrl.algos.tree import depth_prune, width_prune
    from difrl.train.flow.trainer import step_masks
    from difrl.branching import build_tree

    sde, _, _ = step_masks(cfg, 0, 1)
    tree = build_tree(cfg.tree.schedule(cfg.sampler.num_steps), cfg.sampler.num_steps, 1, sde)
    edges = tree.edge_is_sde.nonzero().flatten()
    keep = torch.ones(len(edges), dtype=torch.bool)
    if cfg.tree.depth_prune:
        keep &= depth_prune(tree, edges, cfg.tree.depth_prune)
    if cfg.tree.width_prune != "none":  # the count does not depend on the advantages
        keep = width_prune(tree, edges, torch.zeros(len(edges)), cfg.tree.width_prune, cfg.tree.width_ratio, keep)
    return int(keep.sum()) * cfg.rollout.prompts_per_iter


def rows_of(run_dir: Path) -> tuple[list[dict], dict]:
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return rows, json.loads((run_dir / "summary.json").read_text())


def train_seconds(r: dict) -> float:
    return r["seconds"] - r.get("seconds_eval", 0.0)


def run(name: str, overrides: list[str], run_dir: Path, reuse: bool) -> tuple[list[dict], dict]:
    cfg = method_config(name, overrides)
    if reuse and same_config(cfg, run_dir):
        print(f"{name}: reusing {run_dir}", flush=True)
    else:
        train(cfg, out_dir=run_dir, overwrite=True)
    return rows_of(run_dir)


# ---------------------------------------------------------------------------------- (a) cost


def wide_network(path: Path, hidden: int) -> Path:
    """A randomly initialised digits generator `hidden` wide: the same code path, compute-bound on a CPU."""
    from dataclasses import asdict

    from difrl.models.digits import DigitsFlowNet, DigitsNetConfig
    from difrl.utils.io import save_safetensors

    torch.manual_seed(0)
    net = DigitsFlowNet(DigitsNetConfig(hidden=hidden))
    path.parent.mkdir(parents=True, exist_ok=True)
    save_safetensors(net.state_dict(), path, {k: str(v) for k, v in asdict(net.cfg).items()})
    return path


LEAVES = 160  # trained samples per iteration of every method here: 10 prompts x 16 leaves


def cost_rows(methods: list[str], iterations: int, out: Path, model_path: Path | None = None,
              repeats: int = 2) -> list[dict]:
    """Seconds and NFEs per iteration of each method; `model_path` swaps in another digits generator.
    The methods run in turn, `repeats` rounds; each keeps its fastest round's median (least disturbed)."""
    rows = []
    net = [f"model.path={model_path}"] if model_path else []
    tag = "wide" if model_path else "base"
    rounds = {}
    for k in range(repeats):
        for name in methods:
            ms, _ = run(name, [f"train.iterations={iterations}", "eval.every=0", "eval.per_digit=5", "stop.fd_rise=null",
                               "threads=1", *net], out / f"cost_{tag}" / f"{name.replace(' ', '_')}-{k}", False)
            ms = ms[2:] if len(ms) > 4 else ms  # the first iterations warm up allocators and thread pools
            rounds.setdefault(name, []).append(ms)
    for name in methods:
        ms = min(rounds[name], key=lambda m: statistics.median(train_seconds(r) for r in m))
        sec = statistics.median(train_seconds(r) for r in ms)
        rows.append({"section": f"cost_{tag}", "method": name, "iterations": iterations,
                     "seconds_per_iter": sec,
                     "seconds_rollout": statistics.median(r["seconds_rollout"] for r in ms),
                     "seconds_update": statistics.median(r["seconds_update"] for r in ms),
                     "nfe_rollout": ms[-1]["nfe_full"], "nfe_train": ms[-1]["nfe_train"],
                     # per leaf (10 prompts x 16 leaves), as the table prints them
                     "nfe_rollout_per_leaf": ms[-1]["nfe_full"] / LEAVES, "nfe_train_per_leaf": ms[-1]["nfe_train"] / LEAVES,
                     "edges_trained": ms[-1].get("tree/edges_trained")})
        print(f"cost ({tag}) {name:18s}: {sec:.3f} s/iter, rollout NFE {ms[-1]['nfe_full']}, train NFE {ms[-1]['nfe_train']}",
              flush=True)
    flat = next(r for r in rows if r["method"] == "flat GRPO")
    for r in rows:
        r["ratio_to_flat"] = r["seconds_per_iter"] / flat["seconds_per_iter"]
    return rows


# ---------------------------------------------------------------------------------- (b) learning


def at_budget(rows: list[dict], summary: dict, budget: float | None) -> dict:
    """The last evaluation within `budget` iterations (None: the final one)."""
    t, best = 0.0, {"iteration": 0, "seconds": 0.0, **{k: summary["eval_before"][k] for k in ("accuracy", "fd")}}
    for r in rows:
        t += train_seconds(r)
        if budget is not None and r["iteration"] > budget:
            return best
        if "eval/accuracy" in r:
            best = {"iteration": r["iteration"], "seconds": t, "accuracy": r["eval/accuracy"], "fd": r["eval/fd"]}
    ev = summary["eval_after"]
    return {"iteration": summary["iterations"], "seconds": t, "accuracy": ev["accuracy"], "fd": ev["fd"],
            "judge_accuracy": ev["judge_accuracy"], "diversity": ev["diversity"]}


def learning_rows(methods: list[str], seeds: list[int], iterations: int, every: int, ratios: dict, out: Path,
                  reuse: bool) -> list[dict]:
    runs = {}
    for name in methods:
        iters = iterations if name == "flat GRPO" else int(iterations * TREE_RUN_FACTOR)
        for seed in seeds:
            d = out / "learn" / name.replace(" ", "_") / f"seed{seed}"
            t0 = time.perf_counter()
            # one thread: learning is read at an iteration budget, and a single thread is not slowed by
            # thread-pool oversubscription when the machine is busy
            rows, summary = run(name, [f"seed={seed}", f"train.iterations={iters}", f"eval.every={every}",
                                       "stop.fd_rise=null", "threads=1"], d, reuse)
            runs.setdefault(name, []).append((rows, summary))
            ev = summary["eval_after"]
            print(f"learn {name:18s} seed {seed}: {iters} it, accuracy {ev['accuracy']:.3f}, FD {ev['fd']:.1f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    budget = statistics.mean(sum(train_seconds(r) for r in rows) for rows, _ in runs["flat GRPO"])
    out_rows = []
    for name, rs in runs.items():
        # equal wall-clock = flat's iterations x (flat's s/iter / this method's), both from the calibration
        budget_iters = iterations / ratios[name]
        eq = [at_budget(rows, s, budget_iters if name != "flat GRPO" else None) for rows, s in rs]
        fin = [at_budget(rows, s, None) for rows, s in rs]
        mean = lambda xs, k: statistics.mean(x[k] for x in xs)  # noqa: E731
        std = lambda xs, k: sample_std(x[k] for x in xs)  # noqa: E731
        out_rows.append({
            "section": "learning", "method": name, "seeds": seeds, "iterations": rs[0][1]["iterations"],
            "budget_seconds": budget, "budget_iterations": budget_iters, "iterations_at_budget": mean(eq, "iteration"),
            "seconds_at_budget": mean(eq, "seconds"),
            "accuracy_at_budget": mean(eq, "accuracy"), "accuracy_at_budget_std": std(eq, "accuracy"),
            "fd_at_budget": mean(eq, "fd"), "fd_at_budget_std": std(eq, "fd"),
            "accuracy_final": mean(fin, "accuracy"), "fd_final": mean(fin, "fd"), "seconds_final": mean(fin, "seconds"),
            "judge_final": mean(fin, "judge_accuracy"), "diversity_final": mean(fin, "diversity"),
            "accuracy_before": rs[0][1]["eval_before"]["accuracy"], "fd_before": rs[0][1]["eval_before"]["fd"],
        })
    return out_rows


# ---------------------------------------------------------------------------------- report

NOTES = [
    "Reading it: NFE = network evaluations per iteration (10 prompts x 16 leaves; CFG off), rollout = pi_old sampling,",
    "update = forwards of the trained transitions (x1 here; the KL reference adds one more each in every method).",
    "Seconds are CPU timings (1 thread) of the whole iteration (rollout, reward, advantages, update), evaluations",
    "excluded; each method's fastest of 2 calibration rounds. In (b) a method's budget is flat's iterations x (flat s/iter / its",
    "s/iter) from the base calibration; it is read at its last evaluation inside that; 'final' is the end of its run.",
]


def cost_reading(rows: list[dict]) -> list[str]:
    """Why the time ratios stay above the NFE ratios, with this run's numbers (the base-model cost rows)."""
    cost = {r["method"]: r for r in rows if r["section"] == "cost_base"}
    flat, mix = cost.get("flat GRPO"), cost.get("BranchGRPO-Mix")
    if not flat or not mix:
        return []
    return ["A tree's early steps run few rows per forward, and Mix shrinks only the update: its rollout "
            f"({mix['nfe_rollout_per_leaf']:.2f} evaluations per leaf, {mix['seconds_rollout'] / flat['seconds_rollout']:.2f}x "
            f"flat's rollout seconds) sets a floor under its time ratio ({mix['ratio_to_flat']:.2f}x flat's whole "
            "iteration here). BranchGRPO's FLUX numbers (Mix 0.21x, specs) come from a regime where the backward pass "
            "dwarfs sampling."]


def tables(rows: list[dict]) -> list[str]:
    out = []
    for tag, title in (("base", "the bundled digits generator (hidden 128)"),
                       ("wide", "the same code on a compute-bound generator (random weights, hidden "
                                f"{next((r['hidden'] for r in rows if r.get('hidden')), '?')})")):
        sel = [r for r in rows if r["section"] == f"cost_{tag}"]
        if not sel:
            continue
        out += [f"### (a) Cost per iteration, {title}: one calibration run each, same invocation", "",
                "| method | rollout NFE / iter (per leaf) | update NFE / iter (per leaf) | s / iter | × flat | rollout s | update s |",
                "|---|---:|---:|---:|---:|---:|---:|"]
        for r in sel:
            out.append(f"| {r['method']} | {r['nfe_rollout']} ({r['nfe_rollout_per_leaf']:.2f}) | {r['nfe_train']} "
                   f"({r['nfe_train_per_leaf']:.2f}) | {r['seconds_per_iter']:.3f} | {r['ratio_to_flat']:.2f}× | "
                       f"{r['seconds_rollout']:.3f} | {r['seconds_update']:.3f} |")
        out.append("")
    learn = [r for r in rows if r["section"] == "learning"]
    if learn:
        b = learn[0]
        out += [f"### (b) Learning at equal wall-clock: mean ± std over seeds {b['seeds']} (n={len(b['seeds'])}); budget = flat GRPO's "
                    f"{b['budget_seconds']:.0f} s of training; base accuracy {b['accuracy_before']:.3f}, FD {b['fd_before']:.1f}. "
                + SPREAD_NOTE, "",
                "| method | iterations run | budget (iterations) | evaluated at | its training s | accuracy at budget | "
                "FD at budget | final accuracy | final FD | final judge | final diversity | s at end |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in learn:
            out.append(f"| {r['method']} | {r['iterations']} | {r['budget_iterations']:.0f} | {r['iterations_at_budget']:.0f} | "
                       f"{r['seconds_at_budget']:.0f} | "
                       f"{r['accuracy_at_budget']:.3f} ± {r['accuracy_at_budget_std']:.3f} | "
                       f"{r['fd_at_budget']:.1f} ± {r['fd_at_budget_std']:.1f} | {r['accuracy_final']:.3f} | "
                       f"{r['fd_final']:.1f} | {r['judge_final']:.3f} | {r['diversity_final']:.3f} | {r['seconds_final']:.0f} |")
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    standard_args(ap, "one seed, short runs (~2 min)")
    ap.add_argument("--seeds", type=int, nargs="+", help="training seeds (default 0 1 2; --quick 0)")
    ap.add_argument("--iterations", type=int, help="flat GRPO iterations (default 300, the demo; --quick 30)")
    ap.add_argument("--cost-iterations", type=int, help="calibration iterations (default 30; --quick 8)")
    ap.add_argument("--every", type=int, help="evaluation interval (default 10)")
    ap.add_argument("--wide-hidden", type=int, default=512, help="width of the compute-bound cost run (0 = skip it)")
    ap.add_argument("--wide-iterations", type=int, help="its calibration iterations (default 8; --quick 3)")
    ap.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    ap.add_argument("--skip-learning", action="store_true")
    ap.add_argument("--skip-cost", action="store_true",
                    help="only train the learning runs (e.g. while the machine is busy); a later --reuse run calibrates and reads them")
    ap.add_argument("--reuse", action="store_true", help="reuse finished learning runs of identical configs under --out")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_branch")
    args = ap.parse_args(argv)
    q = args.quick
    methods = ["flat GRPO", *[m for m in args.methods if m != "flat GRPO"]]
    if args.skip_cost:
        learning_rows(methods, args.seeds or ([0] if q else [0, 1, 2]), args.iterations or (30 if q else 300),
                      args.every or 10, {m: 1.0 for m in methods}, args.out, args.reuse)
        return []
    rows = cost_rows(methods, args.cost_iterations or (8 if q else 30), args.out)
    if args.wide_hidden:
        wide = cost_rows(methods, args.wide_iterations or (3 if q else 8), args.out,
                         wide_network(args.out / f"wide{args.wide_hidden}.safetensors", args.wide_hidden))
        rows += [{**r, "hidden": args.wide_hidden} for r in wide]
    if not args.skip_learning:
        ratios = {r["method"]: r["ratio_to_flat"] for r in rows if r["section"] == "cost_base"}
        rows += learning_rows(methods, args.seeds or ([0] if q else [0, 1, 2]), args.iterations or (30 if q else 300),
                              args.every or 10, ratios, args.out, args.reuse)
    publish(args, BEGIN, END, "BranchGRPO: tree rollouts vs flat GRPO (digits world)", "bench_branch.py", argv,
            [*tables(rows), "", *NOTES, *cost_reading(rows)], rows)
    return rows


if __name__ == "__main__":
    main()

"""Every flow method of difrl at equal wall-clock on the digits world and the moving-digits world, several seeds
(issue 48): Flow-GRPO, DiffusionNFT, the best tree, AWM, DPO, DGPO, Flow-DPPO, DRaFT-K, ReFL, GARDO, Pref-GRPO, Sol-RL.

    .venv/bin/python benchmarks/bench_methods.py --jobs 2 --json benchmarks/results/bench_methods.json  # full: ~1.3 h
    .venv/bin/python benchmarks/bench_methods.py --quick                                               # ~1 min, never writes

Each method is its digits config (configs/digits*.yaml) on digits, and the same method's settings as overrides of
configs/moving_digits.yaml on moving digits (METHODS below; the values the digits configs use, scaled where the world
differs). The best tree is the one each world's tree ablations found: BranchGRPO-Mix on digits (benchmarks/
bench_branch.py, SDE only in steps 0-1 and at the splits) and the leaf-weighted TempFlow tree on moving digits
(benchmarks/bench_video.py). A method a world refuses (difrl/train/method_checks.py: DRaFT-K / ReFL need a
differentiable reward, GARDO an auxiliary reward of weight 0) is a "not applicable" row with the refusal's words.

Equal wall-clock, as bench_video.py: per world, the budget is Flow-GRPO's mean training seconds (evaluations
excluded) over seeds of its `--iterations`; every other method runs the same iterations and, if it has not spent the
budget, is resumed (`resume=`, the same run continued exactly) to the first evaluation past it
(common.budget_run); each run is read at its last evaluation inside the budget of its own cumulative training
seconds (common.at_budget). Every run is one thread; --jobs N runs N at once, each in its own process (run_all: a
world's Flow-GRPO seeds first, then its other methods, the dearer first), so with --jobs 2 on 2 cores every run, the
budget's Flow-GRPO runs included, shares the machine with one other run, except the last few. The FD stopping rule
is off (a stopped run would end before the budget). Reported per world and method: accuracy, FD, diversity (against
the real data's) and the held-out judge (moving digits: also motion accuracy and the judge's motion), mean and
sample standard deviation (n - 1) over the seeds, the seed count printed; a method is called better or worse than
Flow-GRPO only where the means differ by more than the two standard deviations together (common.beyond_spread).

Duration, estimated from 3-iteration runs of every method at the full settings on the shared 2-core machine (load
~10, so only the ratios to Flow-GRPO are used) scaled to Flow-GRPO's quiet-machine seconds per iteration (digits
0.17 s, BENCHMARKS.md bench_branch; moving digits 1.40 s, bench_video): every run lasts at least the budget (digits
300 x 0.17 ~ 52 s, moving digits 100 x 1.40 ~ 140 s), a dearer method its own iterations (digits: GARDO ~1.5x,
Pref-GRPO ~1.5x, Sol-RL ~4x; moving digits: Sol-RL ~2x), a resumed one an evaluation more, plus the evaluations
(~0.5 s / ~1 s each). Digits: ~16 budgets per seed ~ 16 min; moving digits (9 applicable methods): ~10 budgets + 100
evaluations per seed ~ 28 min; with 3 seeds ~2 h 15 min of runs in all, ~1.2 h with --jobs 2 on a quiet 2-core
machine. --quick: ~1 min idle (70 s measured at load ~10).
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (common.train_seconds looked up at call time: tests replace the clock)
from common import beyond_spread, publish, standard_args  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- bench_methods:start -->", "<!-- bench_methods:end -->"
CONFIGS = ROOT / "configs"

# world -> its base config, default iterations and evaluation interval (the full run's), its --quick settings and
# the metrics its evaluation returns (difrl/worlds/digits.py image_metrics, moving_digits.py video_metrics)
WORLDS = {
    "digits": {"config": "digits.yaml", "iterations": 300, "every": 25,
               "quick": ["rollout.prompts_per_iter=5", "eval.per_digit=5"],
               "metrics": ("accuracy", "fd", "diversity", "judge_accuracy")},
    "moving_digits": {"config": "moving_digits.yaml", "iterations": 100, "every": 10,
                      "quick": ["rollout.prompts_per_iter=4", "eval.per_digit=2", "eval.num_steps=6"],
                      "metrics": ("accuracy", "motion_accuracy", "fd", "diversity", "judge_accuracy",
                                  "judge_motion_accuracy")},
}
HIGHER = {"accuracy": True, "motion_accuracy": True, "fd": False, "judge_accuracy": True, "judge_motion_accuracy": True}
LABEL = {"accuracy": "accuracy", "motion_accuracy": "motion accuracy", "fd": "FD", "diversity": "diversity",
         "judge_accuracy": "judge accuracy", "judge_motion_accuracy": "judge motion accuracy"}

# GRPO's KL / clip keys back at their defaults where an objective would ignore them (the config refuses them)
NO_CLIP = ["train.clip_low=1e-4", "train.clip_high=1e-4"]
NFT = ["train.objective=nft", "nft.ref_beta=0.1", "train.kl_beta=0", *NO_CLIP]  # as benchmarks/bench_solrl.py
MATCH = ["matching.timestep_fraction=0.6", "matching.rollout=ode", *NO_CLIP]  # digits_awm / dpo / dgpo.yaml's
# method -> world -> (config file, overrides); moving digits: configs/moving_digits.yaml with the method's settings
METHODS = {
    "Flow-GRPO": {"digits": ("digits.yaml", []), "moving_digits": ("moving_digits.yaml", [])},
    "DiffusionNFT": {"digits": ("digits.yaml", NFT), "moving_digits": ("moving_digits.yaml", NFT)},
    "best tree": {
        "digits": ("digits_branch.yaml", ["steps.mode=fixed_window", "steps.window_start=0", "steps.window_size=2",
                                          "train.micro_batch=80", "train.grad_accum=2"]),  # bench_branch's Mix: 320
        # trained edges per iteration in 2 updates of 2 x 80, as its <= 144-record micro-batches
        "moving_digits": ("moving_digits.yaml", ["rollout.kind=tree", "tree.split_steps=[0,1,2,3]", "tree.factor=2",
                                                 "tree.edge_weight=leaves", "train.step_weight=tempflow"])},
    "AWM": {"digits": ("digits_awm.yaml", []),
            "moving_digits": ("moving_digits.yaml", ["train.objective=awm", *MATCH, "awm.weighting=ghuber",
                                                     "awm.ghuber_power=0.25", "awm.adv_clip=5.0", "awm.adv_max=1.0",
                                                     "awm.ema_beta=1.0", "awm.ema_decay_rate=0.001",
                                                     "awm.ema_decay_max=0.3", "train.kl_beta=0.003"])},
    "DPO": {"digits": ("digits_dpo.yaml", []),
            "moving_digits": ("moving_digits.yaml", ["train.objective=dpo", *MATCH, "dpo.beta=200.0", "train.kl_beta=0"])},
    "DGPO": {"digits": ("digits_dgpo.yaml", []),
             "moving_digits": ("moving_digits.yaml", ["train.objective=dgpo", *MATCH, "dgpo.beta=100.0",
                                                      "dgpo.adv_clip=5.0", "train.kl_beta=0.001"])},
    "Flow-DPPO": {"digits": ("digits_dppo.yaml", []),
                  "moving_digits": ("moving_digits.yaml", ["train.objective=dppo", "dppo.kl_threshold=1e-5", *NO_CLIP])},
    "DRaFT-K": {"digits": ("digits_draft.yaml", []),
                "moving_digits": ("moving_digits.yaml", ["train.objective=draft", "draft.k=1", "draft.kernel=ode",
                                                         "train.kl_beta=0", *NO_CLIP, "rollout.group_size=8"])},
    "ReFL": {"digits": ("digits_refl.yaml", []),
             "moving_digits": ("moving_digits.yaml", ["train.objective=refl", "refl.first_step=5", "refl.last_step=7",
                                                      "refl.kernel=ode", "train.kl_beta=0", *NO_CLIP,
                                                      "rollout.group_size=8"])},
    "GARDO": {"digits": ("digits_gardo.yaml", []),
              "moving_digits": ("moving_digits.yaml", ["gardo.enabled=true", "advantage.scale=mean",
                                                       "gardo.kl_frac=0.1", "gardo.reset_every=15"])},
    # moving digits' summed reward spans 0..4 (weights 2 / 1 / 1), digits' p(digit) 0..1: tau scaled by 4
    "Pref-GRPO": {"digits": ("digits_pref_grpo.yaml", []),
                  "moving_digits": ("moving_digits.yaml", ["pref.judge=sigmoid", "pref.tau=0.2"])},
    "Sol-RL": {"digits": ("digits_solrl.yaml", []),
               "moving_digits": ("moving_digits.yaml", ["rollout.kind=solrl", "rollout.precision=nvfp4",
                                                        "solrl.candidates=32", "solrl.preview_steps=4",
                                                        "solrl.select=best_worst"])},  # bench_video's Sol-RL
}
TREE = {"digits": "BranchGRPO-Mix", "moving_digits": "BranchGRPO, leaf weights + TempFlow"}


def run_overrides(world: str, method: str, seed: int, iterations: int, every: int, quick: bool) -> tuple[Path, list[str]]:
    """The config file and overrides of one run: the method's, then the benchmark's (seed, length, evaluations, one
    thread, no early stop; --quick's smaller rollouts and evaluations)."""
    config, extra = METHODS[method][world]
    w = WORLDS[world]
    return CONFIGS / config, [*extra, f"seed={seed}", f"train.iterations={iterations}", f"eval.every={every}",
                              "threads=1", "stop.fd_rise=null", *(w["quick"] if quick else [])]


def refusal(world: str, method: str) -> str | None:
    """Why `world` does not support `method` (the config's own refusal, difrl/train/method_checks.py), or None."""
    from difrl.config import ConfigError
    from difrl.train.config import load_flow_config

    try:
        load_flow_config(*run_overrides(world, method, 0, 1, 1, False))
    except ConfigError as e:
        return str(e).replace(f"{ROOT}/", "")
    return None


def sample_std(xs: list[float]) -> float | None:
    """The sample standard deviation (n - 1) over seeds; None for one seed (no spread measured)."""
    return common.sample_std(xs) if len(xs) > 1 else None


class InProcess:
    """--jobs 1: runs a call when it is submitted, in this process (tests replace common.train_seconds here), and
    hands back a finished Future, so one scheduling loop serves both."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def submit(self, fn, *args) -> Future:
        f = Future()
        try:
            f.set_result(fn(*args))
        except Exception as e:  # noqa: BLE001  (the Future carries it to the method's row)
            f.set_exception(e)
        return f


def run_all(worlds: list[str], methods: list[str], seeds: list[int], lengths: dict, quick: bool, out: Path,
            jobs: int) -> tuple[dict, dict]:
    """Every (world, method, seed) run, `jobs` at a time (each a process of one thread): a world's Flow-GRPO seeds
    first; once all are in, their mean training seconds is the world's budget and its other methods are submitted,
    the dearer ones first (METHODS' order reversed: Sol-RL, Pref-GRPO, GARDO ...), so the last runs left are short.
    Returns ({(world, method, seed): run dict, or the exception the run raised}, {world: budget seconds})."""
    results, budgets, pending = {}, {}, {}

    def submit(pool, world: str, method: str, seed: int, budget: float | None) -> None:
        iterations, every = lengths[world]
        config, overrides = run_overrides(world, method, seed, iterations, every, quick)
        f = pool.submit(common.budget_run, config, overrides, out / world / method.replace(" ", "_") / f"seed{seed}",
                        iterations, every, WORLDS[world]["metrics"], budget)
        pending[f] = (world, method, seed)

    others = {w: [m for m in reversed(methods) if m != "Flow-GRPO" and refusal(w, m) is None] for w in worlds}
    with (InProcess() if jobs == 1 else
          ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))) as pool:
        for w in worlds:
            for s in seeds:
                submit(pool, w, "Flow-GRPO", s, None)
        while pending:
            f = next(as_completed(pending))
            world, method, _ = key = pending.pop(f)
            if method == "Flow-GRPO" and f.exception() is not None:
                raise f.exception()  # no budget without it: the run of hours ends here
            results[key] = f.exception() or f.result()
            if method == "Flow-GRPO" and all((world, "Flow-GRPO", s) in results for s in seeds):
                budgets[world] = statistics.mean(sum(common.train_seconds(r) for r in results[(world, "Flow-GRPO", s)]
                                                     ["rows"]) for s in seeds)
                for m in others[world]:
                    for s in seeds:
                        submit(pool, world, m, s, budgets[world])
    return results, budgets


def world_rows(world: str, methods: list[str], seeds: list[int], iterations: int, every: int, results: dict,
               budget: float) -> list[dict]:
    """One row per method on `world` from run_all's runs, each read at the budget (Flow-GRPO's mean seconds)."""
    metrics = WORLDS[world]["metrics"]
    rows = []
    for method in methods:
        config, extra = METHODS[method][world]
        row = {"world": world, "method": method, "config": f"configs/{config}", "overrides": extra,
               "variant": TREE.get(world) if method == "best tree" else None, "seeds": seeds, "n_seeds": len(seeds),
               "iterations": iterations, "every": every, "budget_seconds": budget}
        why = refusal(world, method)
        if why is not None:
            rows.append({**row, "applicable": False, "reason": why, "error": None})
            continue
        rs = [results[(world, method, s)] for s in seeds]
        failed = [e for e in rs if isinstance(e, Exception)]
        if failed:  # one method's failure is its row's, not the end of a run of hours
            rows.append({**row, "applicable": True, "reason": None,
                         "error": f"{type(failed[0]).__name__}: {failed[0]}"})
            continue
        eq = [common.at_budget(run, budget, metrics) for run in rs]
        row |= {"applicable": True, "reason": None, "error": None,
                "seconds_per_iter": statistics.median(common.train_seconds(r) for run in rs for r in run["rows"]),
                "iterations_run": [run["iterations"] for run in rs],
                "resumed": [run["iterations"] > iterations for run in rs],
                "seconds_at_budget": [e["seconds"] for e in eq], "iterations_at_budget": [e["iteration"] for e in eq],
                "real_diversity": rs[0]["summary"]["eval_before"]["real_diversity"]}
        for k in metrics:
            row[f"{k}_mean"], row[f"{k}_std"] = statistics.mean(e[k] for e in eq), sample_std([e[k] for e in eq])
            row[f"{k}_per_seed"] = [e[k] for e in eq]
            row[f"{k}_before"] = rs[0]["summary"]["eval_before"][k]
        rows.append(row)
    for row in rows:
        if measured(row):
            row["seconds_ratio"] = row["seconds_per_iter"] / rows[0]["seconds_per_iter"]
    return rows


# ---------------------------------------------------------------------------------- sentences, all from the rows


def measured(row: dict) -> bool:
    """The row has measurements: the world takes the method and its runs finished."""
    return row["applicable"] and not row.get("error")


def ms(row: dict, k: str) -> str:
    """'mean ± sample std' (or the mean alone for one seed) of metric `k`."""
    spec = ".1f" if k == "fd" else ".3f"
    m, s = row[f"{k}_mean"], row[f"{k}_std"]
    return f"{m:{spec}}" if s is None else f"{m:{spec}} ± {s:{spec}}"


def compare(row: dict, base: dict, k: str) -> str | None:
    """'better' / 'worse' (diversity: 'higher' / 'lower') than `base` on `k` beyond the spread over seeds; None
    within it or with fewer than 2 seeds (no spread measured: no claim)."""
    if row[f"{k}_std"] is None or base[f"{k}_std"] is None:
        return None
    a, b = row[f"{k}_mean"], base[f"{k}_mean"]
    if not beyond_spread(a, row[f"{k}_std"], b, base[f"{k}_std"]):
        return None
    if k == "diversity":
        return "higher" if a > b else "lower"
    return "better" if (a > b) == HIGHER[k] else "worse"


def method_sentence(row: dict, base: dict) -> str:
    """One method against Flow-GRPO on one world at the budget, every metric; a difference only beyond the spread."""
    name = f"{row['method']} ({row['variant']})" if row["variant"] else row["method"]
    if not row["applicable"]:
        return f"- {name}: not applicable on {row['world']}: {short(row['reason'])}."
    if row.get("error"):
        return f"- {name}: FAILED on {row['world']} (no measurement): {row['error']}."
    ks = WORLDS[row["world"]]["metrics"]
    if row["n_seeds"] < 2:
        vals = ", ".join(f"{LABEL[k]} {ms(row, k)} vs {ms(base, k)}" for k in ks)
        return f"- {name}: {vals} (one seed: no spread over seeds, so no better / worse claim)."
    said, level = [], []
    for k in ks:
        c = compare(row, base, k)
        if c is None:
            level.append(LABEL[k])
        else:
            said.append(f"{c} on {LABEL[k]} ({ms(row, k)} vs {ms(base, k)})")
    what = "; ".join(said) + ("; " if said and level else "") + (
        f"within the spread over seeds on {', '.join(level)}" if level else "")
    return f"- {name}: against Flow-GRPO at equal wall-clock, {what}."


def short(reason: str) -> str:
    """A refusal's sentence up to its advice (the row's JSON keeps it whole)."""
    return reason.split("is invalid: ", 1)[-1].split(";")[0].split(": add them")[0].rstrip(".")


def which_method_when(rows: list[dict]) -> list[str]:
    """The "Which method when" summary: per world the best on each metric (and whether beyond the spread of the
    others), the methods better / worse than Flow-GRPO, the ones that lose diversity, and the refused ones."""
    out = []
    for world in dict.fromkeys(r["world"] for r in rows):
        wr = [r for r in rows if r["world"] == world]
        ok, base = [r for r in wr if measured(r)], wr[0]
        n = base["n_seeds"]
        head = (f"**{world}** (budget {base['budget_seconds']:.0f} s of training, {n} seed{'s' if n > 1 else ''}"
                f"{'' if n > 1 else ': ranks only, no claim'}):")
        parts = [] if len(ok) > 1 else [f"only {', '.join(r['method'] for r in ok)} measured, nothing to rank"]
        for k in WORLDS[world]["metrics"] if len(ok) > 1 else ():
            if k == "diversity":
                continue
            best = max(ok, key=lambda r: r[f"{k}_mean"] if HIGHER[k] else -r[f"{k}_mean"])
            rivals = [r["method"] for r in ok if r is not best and (n < 2 or not beyond_spread(
                best[f"{k}_mean"], best[f"{k}_std"], r[f"{k}_mean"], r[f"{k}_std"]))]
            tie = (f", level within the spread with {', '.join(rivals)}" if rivals and n > 1 else
                   ", beyond the spread of every other" if n > 1 else "")
            parts.append(f"best {LABEL[k]}: {best['method']} ({ms(best, k)}{tie})")
        out.append(f"- {head} " + "; ".join(parts) + ".")
        if n > 1:
            for c, word in (("better", "better than"), ("worse", "worse than")):
                who = [f"{r['method']} ({', '.join(LABEL[k] for k in WORLDS[world]['metrics'] if compare(r, base, k) == c)})"
                       for r in ok[1:] if any(compare(r, base, k) == c for k in WORLDS[world]["metrics"])]
                out.append(f"  - {word} Flow-GRPO beyond the spread over seeds: {', '.join(who) or 'none'}.")
        narrow = [r["method"] for r in ok if r["diversity_mean"] < 0.95 * r["real_diversity"]]
        out.append(f"  - diversity below 0.95x the real data's ({base['real_diversity']:.2f}): "
                   f"{', '.join(narrow) or 'none'}.")
        if world == "digits":  # the bundled demo's goal (issue 48): accuracy >= 0.99, FD <= 20, diversity >= 0.95x real
            goal = [r["method"] for r in ok if r["accuracy_mean"] >= 0.99 and r["fd_mean"] <= 20
                    and r["diversity_mean"] >= 0.95 * r["real_diversity"]]
            reach = {"accuracy >= 0.99": [r["method"] for r in ok if r["accuracy_mean"] >= 0.99],
                     "FD <= 20": [r["method"] for r in ok if r["fd_mean"] <= 20],
                     "diversity >= 0.95x real": [r["method"] for r in ok
                                                 if r["diversity_mean"] >= 0.95 * r["real_diversity"]]}
            out.append(f"  - the demo's goal (accuracy >= 0.99, FD <= 20, diversity >= 0.95x real) at this budget: "
                       f"{', '.join(goal) or 'none'}" + ("" if goal else " (" + "; ".join(
                           f"{c}: {', '.join(who) or 'none'}" for c, who in reach.items()) + ")") + ".")
        na = [f"{r['method']} ({short(r['reason'])})" for r in wr if not r["applicable"]]
        if na:
            out.append(f"  - not applicable: {'; '.join(na)}.")
        failed = [r["method"] for r in wr if r["applicable"] and r.get("error")]
        if failed:
            out.append(f"  - FAILED (no measurement; the error in its row): {', '.join(failed)}.")
    worlds = list(dict.fromkeys(r["world"] for r in rows))
    if len(worlds) > 1 and rows[0]["n_seeds"] > 1:  # what holds on every world run
        verdicts = {}
        for r in rows:
            if measured(r) and r["method"] != "Flow-GRPO":
                base = next(b for b in rows if b["world"] == r["world"])
                verdicts.setdefault(r["method"], []).append({compare(r, base, k) for k in WORLDS[r["world"]]["metrics"]})
        for c in ("better", "worse"):
            every = [m for m, vs in verdicts.items() if len(vs) == len(worlds) and all(c in v for v in vs)]
            out.append(f"- on every world: {c} than Flow-GRPO beyond the spread on at least one metric: "
                       f"{', '.join(every) or 'none'}.")
    return out


def table(rows: list[dict]) -> list[str]:
    """One world's markdown table from its rows."""
    ks = WORLDS[rows[0]["world"]]["metrics"]
    head = ["method", "s / iter", "× Flow-GRPO", "iterations at budget", *[f"{LABEL[k]} at budget" for k in ks]]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in rows:
        name = f"{r['method']} ({r['variant']})" if r["variant"] else r["method"]
        if not measured(r):
            why = f"not applicable: {short(r['reason'])}" if not r["applicable"] else "FAILED (see below)"
            lines.append(f"| {name} | {why} |" + " |" * (len(head) - 2))
            continue
        lines.append(f"| {name} | {r['seconds_per_iter']:.2f} | {r['seconds_ratio']:.2f}× | "
                     f"{', '.join(map(str, r['iterations_at_budget']))} | " + " | ".join(ms(r, k) for k in ks) + " |")
    return lines


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    standard_args(ap, "digits only, Flow-GRPO / the best tree / AWM, one seed, 10 iterations, small evaluations "
                      "(~1 min)")
    ap.add_argument("--worlds", nargs="+", choices=list(WORLDS), help="default both; --quick digits")
    ap.add_argument("--methods", nargs="+", choices=list(METHODS),
                    help="default all; --quick the best tree and AWM (Flow-GRPO always runs: it sets the budget)")
    ap.add_argument("--seeds", type=int, nargs="+", help="training seeds (default 0 1 2; --quick 0)")
    ap.add_argument("--iterations", type=int, help="Flow-GRPO's iterations, the budget (default digits 300, the "
                    "demo's; moving digits 100, bench_video's; --quick 10)")
    ap.add_argument("--every", type=int, help="evaluation interval (default digits 25, moving digits 10; --quick 5)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_methods")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once, each a process of one thread (the full run: 2 "
                    "on 2 cores, so every run shares the machine with one other)")
    args = ap.parse_args(argv)
    q = args.quick
    worlds = args.worlds or (["digits"] if q else list(WORLDS))
    picked = args.methods or (["best tree", "AWM"] if q else list(METHODS))
    methods = ["Flow-GRPO", *[m for m in METHODS if m in picked and m != "Flow-GRPO"]]
    seeds = args.seeds or ([0] if q else [0, 1, 2])
    lengths = {w: (args.iterations or (10 if q else WORLDS[w]["iterations"]),
                   args.every or (5 if q else WORLDS[w]["every"])) for w in worlds}
    results, budgets = run_all(worlds, methods, seeds, lengths, q, args.out, args.jobs)
    rows = [r for w in worlds for r in world_rows(w, methods, seeds, *lengths[w], results, budgets[w])]

    lines = [f"Every method at equal wall-clock per world: the budget is Flow-GRPO's mean training seconds (evaluations "
             "excluded) over its iterations; a method that has not spent it after the same iterations is resumed "
             "(`resume=`, exact) to the first evaluation past it, and every run is read at its last evaluation inside "
             f"the budget. Mean ± sample standard deviation (n - 1) over {len(seeds)} seed{'s' if len(seeds) > 1 else ''} "
             f"{seeds}; 'iterations at budget' per seed. Better / worse only where two means differ by more than their "
             "two standard deviations together.", ""]
    for world in worlds:
        wr = [r for r in rows if r["world"] == world]
        b = wr[0]
        lines += [f"### {world} (configs/{WORLDS[world]['config']} and the method's config), Flow-GRPO {b['iterations']} "
                  f"iterations, budget {b['budget_seconds']:.0f} s, evaluation every {b['every']}; base: " +
                  ", ".join(f"{LABEL[k]} {b[f'{k}_before']:{'.1f' if k == 'fd' else '.3f'}}" for k in WORLDS[world]["metrics"]) +
                  f" (real diversity {b['real_diversity']:.3f})", "", *table(wr), ""]
        lines += [method_sentence(r, b) for r in wr[1:]] + [""]
    summary = which_method_when(rows)
    lines += ["### Which method when (from the rows above)", "", *summary, "",
              "CPU only (no GPU used); seconds are single-thread timings, "
              f"{args.jobs} run{'s' if args.jobs > 1 else ''} at a time on a machine that may have been shared. The "
              "NVFP4 rollout copy of Sol-RL is an exact emulation on the CPU (slower than fp32 there)."]
    publish(args, BEGIN, END, "Methods at equal wall-clock (digits and moving digits)", "bench_methods.py", argv, lines,
            rows)
    return rows


if __name__ == "__main__":
    main()

"""Sol-RL on the digits world: does an NVFP4 candidate pool rank seeds like full precision, and does
training on the regenerated best/worst seeds save full-precision rollouts?

    .venv/bin/python benchmarks/bench_solrl.py --json benchmarks/results/bench_solrl.json   # ~20 min on 2 cores
    .venv/bin/python benchmarks/bench_solrl.py --quick --no-write                            # ~2 min

(b) Rank agreement. For P prompts x N seeds of the bundled base policy, the reward of each seed's
sample from the quantized rollout copy (deterministic solver, 6 and 10 steps) against the reward of
the same seed at full precision (10 steps); per-prompt Spearman and Kendall, median over prompts.
Sol-RL reports Spearman 0.93 / Kendall 0.80 between FP4 and BF16 (specs §1.2). A fp32 6-step row
separates the effect of fewer steps from that of the format.

(c) Learning, several seeds, the same prompts and trained samples per iteration (10 x 16):
  plain GRPO           configs/digits.yaml (the demo): fp32 SDE rollouts, PPO-clip + KL
  DiffusionNFT         fp32 deterministic rollouts, DiffusionNFT (Sol-RL's optimizer), no pool
  naive NVFP4          DiffusionNFT trained directly on the NVFP4 copy's samples
  Sol-RL               configs/digits_solrl.yaml: 64 NVFP4 candidates/prompt in 6 steps -> best 8 + worst 8
                       regenerated at full precision in 10 steps -> DiffusionNFT
Full-precision NFEs count every full-precision network evaluation of the rollouts (and of the
proximal recompute where there is one); low-precision NFEs those of the quantized copy. The FD
stopping rule is off so each method shows what it does by itself. Goal: Sol-RL reaches plain
GRPO's final accuracy with <= 0.4x its full-precision NFEs without a worse FD. The closing sentences name, for
each row against DiffusionNFT, the config keys on which their runs differ (config_differences): naive NVFP4
changes the rollout's format alone; Sol-RL changes the pool, its selection and nft.ref_beta together, so the
selection by itself is benchmarks/bench_solrl_groups.py's study (its own BENCHMARKS.md block).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SPREAD_NOTE, beyond_spread, publish, sample_std, same_config, standard_args, threads_override  # noqa: E402

from difrl.quant import QUANT_PRESETS, RolloutCopy  # noqa: E402
from difrl.rewards import build_reward  # noqa: E402
from difrl.rollout import rollout  # noqa: E402
from difrl.samplers import sigma_schedule  # noqa: E402
from difrl.solrl import rank_agreement, spearman  # noqa: E402
from difrl.train.config import load_flow_config  # noqa: E402
from difrl.train.flow.trainer import train  # noqa: E402
from difrl.worlds import build_world  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- bench_solrl:start -->", "<!-- bench_solrl:end -->"
# digits.yaml's GRPO KL and clip keys back at their defaults: under train.objective=nft they would be ignored, and
# the config refuses an ignored key
NFT = ["train.objective=nft", "nft.ref_beta=0.1", "train.kl_beta=0", "train.clip_low=1e-4", "train.clip_high=1e-4"]
METHODS = {
    "plain GRPO": ("digits.yaml", []),
    "DiffusionNFT": ("digits.yaml", NFT),
    "naive NVFP4": ("digits.yaml", NFT + ["rollout.precision=nvfp4"]),
    "Sol-RL": ("digits_solrl.yaml", []),
}


# ---------------------------------------------------------------------------------- (b) rank agreement


@torch.no_grad()
def agreement_rows(formats: list[str], prompts: int, seeds_per_prompt: int) -> list[dict]:
    world = build_world("digits")
    policy = world.policy
    policy.module.eval()
    reward = build_reward("digit_prob")
    ids = torch.arange(prompts).repeat_interleave(seeds_per_prompt) % len(world.prompts)
    seeds = torch.arange(len(ids)) + 10_000
    texts = [world.prompts[i] for i in ids.tolist()]
    meta = [world.metadata(int(i)) for i in ids]

    def rewards_of(steps: int) -> torch.Tensor:
        out = rollout(policy, texts, seeds, sigma_schedule(steps), "ode", sde_mask=torch.zeros(steps, dtype=torch.bool))
        return reward(policy.decode(out.x_final), texts, meta)["digit_prob"].view(prompts, seeds_per_prompt)

    full = rewards_of(10)
    rows = []
    for fmt in ["fp32", *formats]:
        copy = None if fmt == "fp32" else RolloutCopy(policy.module, fmt, **QUANT_PRESETS["digits"])
        for steps in (6, 10):
            if fmt == "fp32" and steps == 10:
                continue  # the reference itself
            t0 = time.perf_counter()
            if copy is None:
                cand = rewards_of(steps)
            else:
                with copy.active(policy):
                    cand = rewards_of(steps)
            agree = rank_agreement(cand, full)
            rho = torch.tensor([spearman(c, f) for c, f in zip(cand, full)])
            rows.append({"section": "agreement", "format": fmt, "steps": steps, "prompts": prompts,
                         "seeds_per_prompt": seeds_per_prompt, "spearman_median": agree["spearman_median"],
                         "spearman_min": float(rho.nanmin()) if hasattr(rho, "nanmin") else float(rho.min()),
                         "kendall_median": agree["kendall_median"],
                         "reward_mae": float((cand - full).abs().mean()), "seconds": time.perf_counter() - t0})
            r = rows[-1]
            print(f"agreement {fmt:9s} {steps:2d} steps: Spearman {r['spearman_median']:.3f} (min {r['spearman_min']:.3f}), "
                  f"Kendall {r['kendall_median']:.3f}, |dr| {r['reward_mae']:.4f}", flush=True)
    return rows


# ---------------------------------------------------------------------------------- (c) learning


def curve(run_dir: Path) -> list[dict]:
    """[(iteration, cumulative full / low NFEs, accuracy, FD)] at every evaluation, from the run's files."""
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    summary = json.loads((run_dir / "summary.json").read_text())
    full = low = 0
    out = [{"iteration": 0, "nfe_full": 0, "nfe_lowprec": 0, "accuracy": summary["eval_before"]["accuracy"],
            "fd": summary["eval_before"]["fd"]}]
    for r in rows:
        full += r["nfe_full"]
        low += r["nfe_lowprec"]
        if "eval/accuracy" in r:
            out.append({"iteration": r["iteration"], "nfe_full": full, "nfe_lowprec": low,
                        "accuracy": r["eval/accuracy"], "fd": r["eval/fd"]})
    ev = summary["eval_after"]
    out.append({"iteration": summary["iterations"], "nfe_full": full, "nfe_lowprec": low, "accuracy": ev["accuracy"],
                "fd": ev["fd"], "judge_accuracy": ev["judge_accuracy"], "diversity": ev["diversity"]})
    secs = [r["seconds"] - r.get("seconds_eval", 0.0) for r in rows]
    agree = [r["solrl/spearman_median"] for r in rows if "solrl/spearman_median" in r]
    return {"curve": out, "seconds_per_iter": statistics.median(secs) if secs else float("nan"),
            "train_spearman": statistics.median(agree) if agree else None}


def learning_rows(seeds: list[int], grpo_iters: int, nft_iters: int, every: int, out: Path, methods: list[str],
                  reuse: bool = False, threads: int = 1) -> list[dict]:
    runs = {}
    for name in methods:
        config, overrides = METHODS[name]
        iters = grpo_iters if name == "plain GRPO" else nft_iters
        overrides = [*overrides, f"train.iterations={iters}", f"eval.every={every}", "stop.fd_rise=null",
                     *threads_override(threads)]
        for seed in seeds:
            run_dir = out / name.replace(" ", "_") / f"seed{seed}"
            cfg = load_flow_config(ROOT / "configs" / config, [*overrides, f"seed={seed}"])
            t0 = time.perf_counter()
            if reuse and same_config(cfg, run_dir):
                print(f"learning {name}: reusing {run_dir}", flush=True)
            else:
                train(cfg, out_dir=run_dir, overwrite=True)
            runs.setdefault(name, []).append({"seed": seed, **curve(run_dir), "wall_s": time.perf_counter() - t0,
                                              "config": config, "overrides": overrides})
            c = runs[name][-1]["curve"][-1]
            print(f"learning {name:13s} seed {seed}: accuracy {c['accuracy']:.3f}, FD {c['fd']:.1f}, "
                  f"full NFEs {c['nfe_full']}, low NFEs {c['nfe_lowprec']}", flush=True)
    base = runs.get("plain GRPO")
    target = statistics.mean(r["curve"][-1]["accuracy"] for r in base) if base else None
    base_nfe = statistics.mean(r["curve"][-1]["nfe_full"] for r in base) if base else None
    rows = []
    for name, rs in runs.items():
        finals = [r["curve"][-1] for r in rs]
        reach = []
        for r in rs:  # NFEs at the first evaluation reaching plain GRPO's final accuracy
            hit = next((p for p in r["curve"] if target is not None and p["accuracy"] >= target), None)
            if name == "plain GRPO":
                hit = r["curve"][-1]  # the baseline's own budget, by definition
            reach.append(hit)
        hits = [h for h in reach if h is not None]
        rows.append({
            "section": "learning", "method": name, "config": rs[0]["config"], "overrides": rs[0]["overrides"],
            "seeds": [r["seed"] for r in rs], "iterations": finals[0]["iteration"],
            "accuracy_mean": statistics.mean(f["accuracy"] for f in finals),
            "accuracy_std": sample_std(f["accuracy"] for f in finals),
            "fd_mean": statistics.mean(f["fd"] for f in finals), "fd_std": sample_std(f["fd"] for f in finals),
            "judge_mean": statistics.mean(f["judge_accuracy"] for f in finals),
            "nfe_full": statistics.mean(f["nfe_full"] for f in finals),
            "nfe_lowprec": statistics.mean(f["nfe_lowprec"] for f in finals),
            "seconds_per_iter": statistics.mean(r["seconds_per_iter"] for r in rs),
            "target_accuracy": target, "reached": f"{len(hits)}/{len(rs)}",
            "nfe_full_to_target": statistics.mean(h["nfe_full"] for h in hits) if len(hits) == len(rs) else None,
            "nfe_full_to_target_std": sample_std(h["nfe_full"] for h in hits) if len(hits) == len(rs) else None,
            "nfe_lowprec_to_target": statistics.mean(h["nfe_lowprec"] for h in hits) if len(hits) == len(rs) else None,
            "fd_at_target": statistics.mean(h["fd"] for h in hits) if len(hits) == len(rs) else None,
            "train_spearman": rs[0]["train_spearman"],
            "curves": [r["curve"] for r in rs],
        })
        if base_nfe and rows[-1]["nfe_full_to_target"] is not None:
            rows[-1]["nfe_full_to_target_ratio"] = rows[-1]["nfe_full_to_target"] / base_nfe
    return rows


# ---------------------------------------------------------------------------------- report

NOTES = [
    "Reading it: NFEs are rollout network evaluations summed over the run (CFG off: one per sample and step);",
    "evaluation sampling is not counted. 'to target' is the first evaluation (every 10 iterations) whose accuracy",
    "reaches plain GRPO's final mean accuracy, averaged over seeds. Seconds per iteration are CPU timings with",
    "NVFP4 *emulated* (slower than fp32 on a CPU; the speed-up needs Blackwell FP4 GEMMs), so only the NFE",
    "columns measure the method. Sol-RL runs nft.ref_beta=0.3 (configs/digits_solrl.yaml), the other DiffusionNFT",
    "rows 0.1: training on the best and worst of 64 pushes harder and needs the stronger pull toward the base.",
]


def tables(rows: list[dict]) -> list[str]:
    out = ["### (b) NVFP4 / FP8 candidates vs full precision: per-prompt rank agreement of rewards", "",
           "| candidate format | steps | Spearman median (min) | Kendall median | mean abs reward diff |",
           "|---|---:|---:|---:|---:|"]
    for r in (r for r in rows if r["section"] == "agreement"):
        out.append(f"| {r['format']} | {r['steps']} | {r['spearman_median']:.3f} ({r['spearman_min']:.3f}) | "
                   f"{r['kendall_median']:.3f} | {r['reward_mae']:.4f} |")
    learn = [r for r in rows if r["section"] == "learning"]
    if learn:
        target = learn[0]["target_accuracy"]
        out += ["", f"### (c) Learning: mean ± std over seeds {learn[0]['seeds']} (n={len(learn[0]['seeds'])}); target = "
                    f"plain GRPO's final accuracy {target:.3f}" if target is not None else "", "", SPREAD_NOTE, "",
                "| method | iterations | accuracy | FD | judge | full-prec. NFEs | low-prec. NFEs | s / iter | "
                "full-prec. NFEs to target (× plain GRPO's) | low-prec. NFEs to target | FD there | train Spearman |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in learn:
            to = (f"{r['nfe_full_to_target']:.3g} ({r.get('nfe_full_to_target_ratio', float('nan')):.2f}×)"
                  if r["nfe_full_to_target"] is not None else f"not reached ({r['reached']})")
            to_low = f"{r['nfe_lowprec_to_target']:.3g}" if r["nfe_lowprec_to_target"] is not None else "–"
            fd_t = f"{r['fd_at_target']:.1f}" if r["fd_at_target"] is not None else "–"
            sp = f"{r['train_spearman']:.3f}" if r["train_spearman"] is not None else "–"
            out.append(f"| {r['method']} | {r['iterations']} | {r['accuracy_mean']:.3f} ± {r['accuracy_std']:.3f} | "
                       f"{r['fd_mean']:.1f} ± {r['fd_std']:.1f} | {r['judge_mean']:.3f} | {r['nfe_full']:.3g} | "
                       f"{r['nfe_lowprec']:.3g} | {r['seconds_per_iter']:.2f} | {to} | {to_low} | {fd_t} | {sp} |")
    return out


def config_differences(a: dict, b: dict) -> dict[str, tuple]:
    """{dotted key: (value in a, value in b)} for every config key (the run directory aside) on which two learning
    rows' runs differ, read from the configs they loaded (each row's config file and overrides, seed aside)."""
    def leaves(obj, prefix: str = "") -> dict:
        if not dataclasses.is_dataclass(obj):
            return {prefix[:-1]: obj}
        return {k: v for f in dataclasses.fields(obj) for k, v in leaves(getattr(obj, f.name), f"{prefix}{f.name}.").items()}

    ca, cb = (leaves(load_flow_config(ROOT / "configs" / r["config"], r["overrides"])) for r in (a, b))
    return {k: (ca[k], cb[k]) for k in ca if k != "out" and ca[k] != cb[k]}


def claim(what: str, a: dict, b: dict, key: str, lower_is_better: bool = False) -> str:
    """`what` of rows a and b (mean ± std over seeds), with better / worse only beyond the spread (common.beyond_spread)."""
    ma, sa, mb, sb = a[f"{key}_mean"], a[f"{key}_std"], b[f"{key}_mean"], b[f"{key}_std"]
    nums = f"{what} {ma:.3g} ± {sa:.2g} vs {mb:.3g} ± {sb:.2g}"
    if len(a["seeds"]) < 2 or len(b["seeds"]) < 2:
        return f"{nums} (one seed: no claim)"
    if not beyond_spread(ma, sa, mb, sb):
        return f"{nums}, within the spread"
    return f"{nums}, {'better' if (ma < mb) == lower_is_better else 'worse'} beyond the spread"


def cost_reading(rows: list[dict], fp4_cost: float) -> list[str]:
    """Sentences computed from the learning rows: total rollout cost to the target with low-precision NFEs
    priced at `fp4_cost` full-precision NFEs (an assumption, stated); then what each row's comparison with
    DiffusionNFT (the same objective, fp32 rollouts, no pool) isolates: the config keys on which their runs differ
    (config_differences), one key = isolated, and what Sol-RL's pool buys in NFEs. The selection alone is
    bench_solrl_groups.py's study, which the last sentence names. Each derived figure it prints (the total
    cost and its ratio, the price, the keys and their values) is stored in its row too, so the JSON holds every
    figure of the block (scripts/check_claims.py)."""
    learn = {r["method"]: r for r in rows if r["section"] == "learning"}
    if not learn:
        return []
    out = [f"Total rollout cost to the target, pricing one low-precision NFE at {fp4_cost:g} full-precision NFE "
           "(an assumed FP4:BF16 cost ratio, not measured here: NVFP4 is emulated on this CPU):"]
    base = learn.get("plain GRPO")
    for name, r in learn.items():
        if r["nfe_full_to_target"] is None:
            out.append(f"- {name}: did not reach the target ({r['reached']}).")
            continue
        total = r["nfe_full_to_target"] + fp4_cost * (r["nfe_lowprec_to_target"] or 0.0)
        r |= {"fp4_cost": fp4_cost, "total_cost_to_target": total}
        rel = ""
        if base and base["nfe_full_to_target"]:
            r["total_cost_ratio"] = total / base["nfe_full_to_target"]
            rel = f" ({r['total_cost_ratio']:.2f}x plain GRPO's)"
        out.append(f"- {name}: {total:.3g}{rel}.")
    nft = learn.get("DiffusionNFT")
    if nft is None:
        return out
    out += ["", "What each row isolates against DiffusionNFT, from the config keys on which their runs differ "
                "(values: the row's vs DiffusionNFT's):"]
    for name, r in learn.items():
        if name == "DiffusionNFT":
            continue
        diff = config_differences(r, nft)
        r |= {"differences_from": "DiffusionNFT", "config_differences": {k: list(v) for k, v in diff.items()},
              "config_differences_count": len(diff)}
        keys = ", ".join(f"{k} {va} vs {vb}" for k, (va, vb) in diff.items())
        what = (f"only {keys}: the pair isolates {next(iter(diff))}" if len(diff) == 1 else
                f"{len(diff)} keys ({keys}): the pair does not isolate any one of them")
        nfe = ""
        if name == "Sol-RL" and r["nfe_full_to_target"] is not None and nft["nfe_full_to_target"] is not None:
            m, s, mb, sb = (x[k] for x in (r, nft) for k in ("nfe_full_to_target", "nfe_full_to_target_std"))
            saved = ("one seed: no claim" if len(r["seeds"]) < 2 else "within the spread" if not beyond_spread(m, s, mb, sb)
                     else f"{'fewer' if m < mb else 'more'} beyond the spread")
            nfe = (f"; full-precision NFEs to the target {m:.3g} ± {s:.2g} vs {mb:.3g} ± {sb:.2g} ({saved}), plus "
                   f"{r['nfe_lowprec_to_target']:.3g} low-precision NFEs")
        out.append(f"- {name}: {what}; {claim('final accuracy', r, nft, 'accuracy')}; "
                   f"{claim('final FD', r, nft, 'fd', lower_is_better=True)}{nfe}.")
    if "Sol-RL" in learn:
        out.append("Sol-RL's row therefore does not measure its best/worst selection by itself: that is the "
                   "bench_solrl_groups block (benchmarks/bench_solrl_groups.py), best/worst against a random group "
                   "of the same pool at equal NFEs, one nft.ref_beta at a time.")
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    standard_args(ap, "one seed, short runs, small pool (~2 min)")
    ap.add_argument("--seeds", type=int, nargs="+", help="training seeds (default 0 1 2; --quick 0)")
    ap.add_argument("--formats", nargs="+", default=["nvfp4", "mxfp8", "fp8"])
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--pool", type=int, help="seeds per prompt for (b) (default 64; --quick 24)")
    ap.add_argument("--grpo-iterations", type=int, help="plain GRPO iterations (default 300, the demo; --quick 30)")
    ap.add_argument("--nft-iterations", type=int, help="the other methods' iterations (default 150; --quick 30)")
    ap.add_argument("--every", type=int, help="evaluation interval (default 10; --quick 10)")
    ap.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    ap.add_argument("--skip-learning", action="store_true")
    ap.add_argument("--reuse", action="store_true", help="reuse finished runs of identical configs under --out")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_solrl")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of both sections, the training runs' "
                    "`threads` key included (default 1: on a shared machine a second thread can make each step many "
                    "times slower; measured 40 s against 0.14 s per plain GRPO iteration under a load of 7 on 2 cores)")
    ap.add_argument("--fp4-cost", type=float, default=0.25, help="price of one low-precision NFE in full-precision "
                    "NFEs for the total-cost sentences (an assumption: 0.25 = FP4 at 4x BF16 throughput)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    q = args.quick
    rows = agreement_rows(args.formats, args.prompts, args.pool or (24 if q else 64))
    if not args.skip_learning:
        rows += learning_rows(args.seeds or ([0] if q else [0, 1, 2]), args.grpo_iterations or (30 if q else 300),
                              args.nft_iterations or (30 if q else 150), args.every or 10, args.out, args.methods, args.reuse,
                              args.threads)
    publish(args, BEGIN, END, "Sol-RL: NVFP4 candidate ranking and learning per full-precision NFE", "bench_solrl.py",
            argv, [*tables(rows), "", *NOTES, "", *cost_reading(rows, args.fp4_cost)], rows)
    return rows


if __name__ == "__main__":
    main()

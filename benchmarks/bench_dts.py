"""Diffusion Tree Sampling on the digits world: DTS* against best-of-N at equal NFE budgets, and DTS
against the base sampler (reward and diversity).

    .venv/bin/python benchmarks/bench_dts.py --json benchmarks/results/bench_dts.json   # ~2 min on 2 cores
    .venv/bin/python benchmarks/bench_dts.py --quick --no-write                         # ~30 s

The bundled base generator, 10 steps of the demo's flow_sde kernel (a = 0.7, last step Euler), all 10
prompts x --seeds. The searched reward is the classifier's logit margin (digit_margin: logit of the
prompted digit minus the largest other; digit_prob saturates at 1 after a few samples, the margin
does not). Reported alongside: p(prompted digit) and whether the classifier's argmax is the prompt.

(a) Search: DTS* (argmax descent, --root-children initial noises, 2 children per node) and best-of-N (N = budget
/ 10 independent samples of the same kernel) at budgets of 20..320 NFEs; the best sample's reward.
Both are anytime: a budget's result is the prefix of the largest run (difrl.search docstring), so one
run per prompt and seed gives the whole curve. 'DTS* budget to match' = the smallest budget at which
DTS*'s mean best reward reaches best-of-N's at the largest budget.
(b) Sampling: 16 samples per prompt from the base sampler vs 16 DTS draws (descents prop. to
exp(lam v)) from a tree of 320 NFEs (2x the base's 160), lam in --lams: mean reward, accuracy,
within-prompt diversity (mean pairwise L2 of the images) and distinct samples out of 16.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import publish, sample_std, standard_args  # noqa: E402

from difrl.eval.metrics import within_class_diversity  # noqa: E402
from difrl.rewards import build_reward  # noqa: E402
from difrl.samplers import sigma_schedule  # noqa: E402
from difrl.search import SearchConfig, best_of_n, dts  # noqa: E402
from difrl.worlds import build_world  # noqa: E402

BEGIN, END = "<!-- bench_dts:start -->", "<!-- bench_dts:end -->"
STEPS = 10


def search_rows(policy, prompts, score, full, seeds, budgets, lam, root_children=8) -> list[dict]:
    sig = sigma_schedule(STEPS)
    top = max(budgets)
    bon_budgets = budgets + [2 * top, 4 * top]  # best-of-N further out, so DTS*'s largest budget has an equivalent
    per = {("DTS*", b): [] for b in budgets} | {("best-of-N", b): [] for b in bon_budgets}
    for seed in seeds:
        for p in prompts:
            t = dts(policy, p, score, sig, SearchConfig(budget=top, lam=lam, root_children=root_children),
                    seed=seed, star=True)
            bon = best_of_n(policy, p, score, sig, 4 * top // STEPS, seed)
            for b in budgets:
                j = next((i for i, n in enumerate(t.leaf_nfe) if n > b), len(t.leaf_nfe))
                k = max(range(j), key=t.rewards.__getitem__)
                per[("DTS*", b)].append((t.rewards[k], t.decoded[k], p))
            for b in bon_budgets:
                n = b // STEPS
                i = int(bon["rewards"][:n].argmax())
                per[("best-of-N", b)].append((float(bon["rewards"][i]), policy.decode(bon["samples"][i][None])[0], p))
    rows = []
    for (method, b), vals in per.items():
        images = torch.stack([v[1] for v in vals])
        extra = full(images, [v[2] for v in vals])
        rows.append({"section": "search", "method": method, "budget": b, "reward": statistics.mean(v[0] for v in vals),
                     "reward_std": sample_std(v[0] for v in vals), "digit_prob": float(extra["prob"].mean()),
                     "accuracy": float(extra["correct"].mean()), "n": len(vals), "root_children": root_children})
    curve = sorted((r["budget"], r["reward"]) for r in rows if r["method"] == "best-of-N")
    for r in rows:
        if r["method"] == "DTS*":
            r["best_of_n_equivalent_budget"] = equivalent_budget(curve, r["reward"])
    return rows


def equivalent_budget(curve: list[tuple[int, float]], reward: float) -> float | None:
    """The best-of-N budget with the same mean best reward, interpolated in log(budget) on the measured
    curve (None outside it)."""
    for (b0, r0), (b1, r1) in zip(curve, curve[1:]):
        if r0 <= reward <= r1 and r1 > r0:
            w = (reward - r0) / (r1 - r0)
            return float(math.exp(math.log(b0) + w * (math.log(b1) - math.log(b0))))
    return None


def sampling_rows(policy, prompts, score, full, seeds, lams, k=16, budget=320) -> list[dict]:
    sig = sigma_schedule(STEPS)
    out = {"base sampler": []} | {f"DTS lam={lam:g}": [] for lam in lams}
    for seed in seeds:
        for pid, p in enumerate(prompts):
            base = best_of_n(policy, p, score, sig, k, seed)
            out["base sampler"].append((base["rewards"], policy.decode(base["samples"]), p, pid, k))
            for lam in lams:
                t = dts(policy, p, score, sig, SearchConfig(budget=budget, lam=lam), seed=seed)
                x, nodes = t.samples(k, torch.Generator().manual_seed(seed))
                imgs = policy.decode(x)
                out[f"DTS lam={lam:g}"].append((score(imgs, p), imgs, p, pid, len(set(nodes))))
    rows = []
    for method, vals in out.items():
        images = torch.cat([v[1] for v in vals])
        prompts_of = [v[2] for v in vals for _ in range(len(v[1]))]
        # diversity within each (prompt, seed) set of k, averaged
        groups = torch.arange(len(vals)).repeat_interleave(k)
        extra = full(images, prompts_of)
        rows.append({"section": "sampling", "method": method, "nfe_per_prompt": k * STEPS if method == "base sampler" else budget,
                     "reward": float(torch.cat([v[0] for v in vals]).mean()), "digit_prob": float(extra["prob"].mean()),
                     "accuracy": float(extra["correct"].mean()), "diversity": within_class_diversity(images, groups),
                     "distinct": statistics.mean(v[4] for v in vals), "k": k})
    return rows


def tables(rows: list[dict], lam: float) -> list[str]:
    s = [r for r in rows if r["section"] == "search"]
    budgets = sorted({r["budget"] for r in s if r["method"] == "DTS*"})
    extra_bon = sorted({r["budget"] for r in s if r["method"] == "best-of-N"} - set(budgets))
    get = lambda m, b: next(r for r in s if r["method"] == m and r["budget"] == b)  # noqa: E731
    out = [f"### (a) DTS* (lam = {lam:g}, {s[0]['root_children']} initial noises, 2 children per node) vs best-of-N at equal NFE: the best sample's reward (logit margin), mean ± sample std "
           f"(n - 1) over n={s[0]['n']} prompt x seed runs; its p(prompted digit) and accuracy", "",
           "| NFE budget | best-of-N (N) | DTS* | DTS* = best-of-N at (NFE) | best-of-N p / acc | DTS* p / acc |",
           "|---:|---:|---:|---:|---:|---:|"]
    for b in budgets:
        x, y = get("best-of-N", b), get("DTS*", b)
        eq = y["best_of_n_equivalent_budget"]
        eq = f"{eq:.0f} ({eq / b:.2f}x)" if eq is not None else "outside the measured curve"
        out.append(f"| {b} | {x['reward']:.2f} ± {x['reward_std']:.2f} ({b // STEPS}) | {y['reward']:.2f} ± {y['reward_std']:.2f} | "
                   f"{eq} | {x['digit_prob']:.3f} / {x['accuracy']:.3f} | {y['digit_prob']:.3f} / {y['accuracy']:.3f} |")
    for b in extra_bon:
        x = get("best-of-N", b)
        out.append(f"| {b} | {x['reward']:.2f} ± {x['reward_std']:.2f} ({b // STEPS}) | – | – | "
                   f"{x['digit_prob']:.3f} / {x['accuracy']:.3f} | – |")
    out += ["", "'DTS* = best-of-N at': the best-of-N budget with DTS*'s mean best reward (log-interpolated on the best-of-N",
            "column, measured out to 4x the largest budget). Up to 8 x 10 NFEs DTS* only draws its 8 initial noises (best-of-N with other seeds); it branches after."]
    sm = [r for r in rows if r["section"] == "sampling"]
    out += ["", f"### (b) DTS vs the base sampler: {sm[0]['k']} samples per prompt, mean over prompts x seeds", "",
            "| sampler | NFE / prompt | reward (margin) | p(prompted digit) | accuracy | diversity | distinct of 16 |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for r in sm:
        out.append(f"| {r['method']} | {r['nfe_per_prompt']} | {r['reward']:.2f} | {r['digit_prob']:.3f} | {r['accuracy']:.3f} | "
                   f"{r['diversity']:.3f} | {r['distinct']:.1f} |")
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    standard_args(ap, "one seed, budgets up to 80 (~30 s)")
    ap.add_argument("--seeds", type=int, nargs="+", help="search seeds (default 0 1 2; --quick 0)")
    ap.add_argument("--budgets", type=int, nargs="+", help="NFE budgets (default 20 40 80 160 320; --quick 20 40 80)")
    ap.add_argument("--lam", type=float, default=1.0, help="DTS* lam (value backup)")
    ap.add_argument("--root-children", type=int, default=8, help="DTS* initial noises (the root's children cap)")
    ap.add_argument("--lams", type=float, nargs="+", default=[0.5, 1.0, 2.0], help="DTS lams for (b)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (one-row forwards: 1 is fastest)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    q = args.quick
    world = build_world("digits")
    margin, prob = build_reward("digit_margin"), build_reward("digit_prob")

    def score(images, prompt):
        return margin(images, [prompt] * len(images), None)["digit_margin"]

    def full(images, prompts):
        r = prob(images, prompts, None)
        return {"prob": r["digit_prob"], "correct": r["correct"]}

    t0 = time.perf_counter()
    seeds = args.seeds or ([0] if q else [0, 1, 2])
    rows = search_rows(world.policy, world.prompts, score, full, seeds, args.budgets or ([20, 40, 80] if q else [20, 40, 80, 160, 320]),
                       args.lam, args.root_children)
    rows += sampling_rows(world.policy, world.prompts, score, full, seeds, args.lams[:1] if q else args.lams,
                          budget=160 if q else 320)
    publish(args, BEGIN, END, "DTS / DTS*: tree search at inference (digits world)", "bench_dts.py", argv,
            [*tables(rows, args.lam), "", f"Wall time {time.perf_counter() - t0:.0f} s."], rows)
    return rows


if __name__ == "__main__":
    main()

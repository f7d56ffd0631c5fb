"""Sol-RL's selection against a random group of the same pool, by group size and KL pull (digits).

    .venv/bin/python benchmarks/bench_solrl_groups.py --json benchmarks/results/bench_solrl_groups.json   # ~30 min alone
    .venv/bin/python benchmarks/bench_solrl_groups.py --quick                                               # ~2 min, never writes

BENCHMARKS' Sol-RL block (c) finds no full-precision NFE saved on digits: Sol-RL (configs/digits_solrl.yaml,
nft.ref_beta 0.3) against plain DiffusionNFT (nft.ref_beta 0.1). That comparison changes two things at once, the
selection and the pull toward the base. Here only the selection changes: every run is configs/digits_solrl.yaml
(64 NVFP4 candidates per prompt in 6 ODE steps, the chosen seeds regenerated at full precision in 10 steps,
DiffusionNFT) with `solrl.select` `best_worst` (Sol-RL) or `random` (the same pool, a uniform choice: plain
DiffusionNFT's group at the same cost), at each `rollout.group_size` (trained samples per prompt: 4, where a
random group is more often all right or all wrong, and the config's 16) and each `nft.ref_beta` (the config's
0.3 and bench_solrl's 0.1). The two rules of one setting spend exactly the same full- and low-precision NFEs.
Reported per setting: the held-out accuracy at the midpoint and the end (mean ± std over seeds), FD, the judge,
and the share of trained groups whose digit does not vary (all right or all wrong; the trainer's
`reward/digit_prob/correct/uniform_groups`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SPREAD_NOTE, beyond_spread, mean_std, publish, same_config, standard_args  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- bench_solrl_groups:start -->", "<!-- bench_solrl_groups:end -->"
CONFIG = ROOT / "configs" / "digits_solrl.yaml"
RULES = ("best_worst", "random")
CONFIG_REF_BETA = 0.3  # configs/digits_solrl.yaml's nft.ref_beta (bench_solrl's plain DiffusionNFT runs 0.1)
UNIFORM = "reward/digit_prob/correct/uniform_groups"  # trained groups whose digit does not vary (reward_stage.reward_stats)


def one_run(group: int, ref_beta: float, rule: str, seed: int, iterations: int, every: int, out: Path,
            extra: list[str], reuse: bool) -> tuple[list[dict], dict]:
    from difrl.train.config import load_flow_config
    from difrl.train.flow.trainer import train

    cfg = load_flow_config(CONFIG, [f"rollout.group_size={group}", f"nft.ref_beta={ref_beta}", f"solrl.select={rule}",
                                    f"seed={seed}",
                                    f"train.iterations={iterations}", f"eval.every={every}", "stop.fd_rise=null", "threads=1",
                                    *extra])
    d = out / (f"group{group}_{rule}" + ("" if ref_beta == CONFIG_REF_BETA else f"_ref{ref_beta:g}")) / f"seed{seed}"
    if not (reuse and same_config(cfg, d)):
        train(cfg, out_dir=d, overwrite=True)
    rows = [json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return rows, json.loads((d / "summary.json").read_text())


def verdict(a: tuple[float, float], b: tuple[float, float], n_seeds: int, lower_is_better: bool = False) -> str:
    """best_worst (a) against random (b), mean ± sample std over seeds: better / worse only beyond the spread
    (common.beyond_spread)."""
    (ma, sa), (mb, sb) = a, b
    if n_seeds < 2:
        return f"{ma:.3f} vs {mb:.3f} (one seed: no claim)"
    if not beyond_spread(ma, sa, mb, sb):
        return f"level, within the seed spread ({ma:.3f} ± {sa:.3f} vs {mb:.3f} ± {sb:.3f})"
    better = (ma < mb) if lower_is_better else (ma > mb)
    return f"{'better' if better else 'worse'} beyond the seed spread ({ma:.3f} ± {sa:.3f} vs {mb:.3f} ± {sb:.3f})"


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    standard_args(ap, "seed 0, group 4, 4 iterations, 5 prompts, small evaluations (~1 min)")
    ap.add_argument("--seeds", type=int, nargs="+", help="training seeds (default 0 1 2; --quick 0)")
    ap.add_argument("--groups", type=int, nargs="+", help="trained samples per prompt (default 4 16; --quick 4)")
    ap.add_argument("--ref-betas", type=float, nargs="+", help="nft.ref_beta values (default 0.3 0.1: the config's and "
                    "bench_solrl's plain DiffusionNFT's; --quick 0.3)")
    ap.add_argument("--iterations", type=int, help="iterations per run (default 150, the config's; --quick 4)")
    ap.add_argument("--every", type=int, help="evaluation interval (default 75: the midpoint; --quick 2)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_solrl_groups")
    ap.add_argument("--reuse", action="store_true", help="take finished runs of identical configs from --out")
    args = ap.parse_args(argv)
    q = args.quick
    seeds = args.seeds or ([0] if q else [0, 1, 2])
    groups = args.groups or ([4] if q else [4, 16])
    betas = args.ref_betas or ([CONFIG_REF_BETA] if q else [CONFIG_REF_BETA, 0.1])
    iterations = args.iterations or (4 if q else 150)
    every = args.every or (2 if q else iterations // 2)
    extra = ["rollout.prompts_per_iter=5", "eval.per_digit=4"] if q else []  # 5 x 4 = 10 micro-batches of 2

    table = []
    for group, beta, rule in ((g, b, r) for g in groups for b in betas for r in RULES):
        rs = [one_run(group, beta, rule, s, iterations, every, args.out, extra, args.reuse) for s in seeds]
        mid = [r["eval/accuracy"] for rows, _ in rs for r in rows if r["iteration"] == every and "eval/accuracy" in r]
        row = {"group_size": group, "ref_beta": beta, "select": rule, "seeds": seeds, "iterations": iterations, "every": every,
               "nfe_full_per_iter": statistics.median(r["nfe_full"] for rows, _ in rs for r in rows),
               "nfe_lowprec_per_iter": statistics.median(r["nfe_lowprec"] for rows, _ in rs for r in rows),
               "no_contrast": mean_std([statistics.mean(r[UNIFORM] for r in rows) for rows, _ in rs]),
               "accuracy_mid": mean_std(mid) if mid else (float("nan"), 0.0),
               "accuracy_before": rs[0][1]["eval_before"]["accuracy"], "fd_before": rs[0][1]["eval_before"]["fd"]}
        for k in ("accuracy", "fd", "judge_accuracy"):
            row[k] = mean_std([s["eval_after"][k] for _, s in rs])
        table.append(row)
        print(row, flush=True)

    lines = [f"Digits world, configs/digits_solrl.yaml with `rollout.group_size`, `nft.ref_beta` (the pull toward "
             f"the base; the config's {CONFIG_REF_BETA:g}) and `solrl.select` changed, {iterations} iterations, seeds "
             f"{seeds} (n={len(seeds)}), mean ± sample std over seeds. Base: accuracy {table[0]['accuracy_before']:.3f}, FD "
             f"{table[0]['fd_before']:.1f}. The two rules of one group size spend the same NFEs (the columns); 'groups "
             "without contrast' is the share of trained groups whose digit does not vary, over the run. " + SPREAD_NOTE, "",
             f"| trained / prompt | ref_beta | selection | full-prec. NFE / iter | low-prec. NFE / iter | groups without "
             f"contrast | accuracy at {every} | accuracy at {iterations} | FD at {iterations} | judge at {iterations} |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in table:
        lines.append(f"| {r['group_size']} | {r['ref_beta']:g} | {r['select']} | {r['nfe_full_per_iter']:.0f} | "
                     f"{r['nfe_lowprec_per_iter']:.0f} | {r['no_contrast'][0]:.2f} ± {r['no_contrast'][1]:.2f} | "
                     f"{r['accuracy_mid'][0]:.3f} ± {r['accuracy_mid'][1]:.3f} | {r['accuracy'][0]:.3f} ± "
                     f"{r['accuracy'][1]:.3f} | {r['fd'][0]:.1f} ± {r['fd'][1]:.1f} | {r['judge_accuracy'][0]:.3f} ± "
                     f"{r['judge_accuracy'][1]:.3f} |")
    lines.append("")
    n = len(seeds)
    for group, beta in ((g, b) for g in groups for b in betas):
        bw, rnd = (next(r for r in table if (r["group_size"], r["ref_beta"], r["select"]) == (group, beta, rule))
                   for rule in RULES)
        lines.append(f"- {group} trained per prompt, ref_beta {beta:g}, best/worst against a random choice of the same "
                     f"pool at equal NFEs: accuracy at {every} {verdict(bw['accuracy_mid'], rnd['accuracy_mid'], n)}; at "
                     f"{iterations} {verdict(bw['accuracy'], rnd['accuracy'], n)}; FD {verdict(bw['fd'], rnd['fd'], n, True)};"
                     f" groups without contrast {bw['no_contrast'][0]:.2f} vs {rnd['no_contrast'][0]:.2f}.")
    lines += ["", "CPU only (no GPU used); the NVFP4 candidates are the exact CPU emulation. NFEs, not seconds, are the "
              "cost here: both rules of a group size run the same pool and the same regeneration."]
    publish(args, BEGIN, END, "Sol-RL: best/worst vs a random group of the same pool, by group size and KL pull (digits)",
            "bench_solrl_groups.py", argv, lines, table)
    return table


if __name__ == "__main__":
    main()

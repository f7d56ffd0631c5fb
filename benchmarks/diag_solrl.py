"""Does Sol-RL's best/worst selection give the trained group more signal than a random group? (base policies)

    PYTHONPATH=. .venv/bin/python benchmarks/diag_solrl.py --json benchmarks/results/diag_solrl.json   # ~2 min
    PYTHONPATH=. .venv/bin/python benchmarks/diag_solrl.py --quick                                       # ~30 s

For each world, with its Sol-RL settings (digits: configs/digits_solrl.yaml, 64 candidates, 6 preview steps,
DiffusionNFT's deterministic rollouts; moving digits: benchmarks/bench_video.py's Sol-RL, 32 candidates, 4
preview steps, Flow-GRPO's SDE rollouts), per prompt: a pool of candidate seeds previewed by the ODE in the
preview steps (here at full precision, so only the selection is measured: BENCHMARKS' Sol-RL block (b) has the
NVFP4 preview's rank agreement), then the trained group is regenerated from the chosen seeds with the
trainer's own sampler: the best 8 and worst 8 by preview reward ("selected"), or the first 16 seeds
("random": plain GRPO/NFT at the same full-precision NFE). Reported per kind of group, mean over prompts:
the reward spread (std) inside the group, the attribute contrast (mean "correct" of the group's upper half by
reward minus its lower half: the digit for digits, the motion direction for moving digits), the share of
groups where the attribute does not vary, and the preview's Spearman correlation with the regenerated reward.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_json  # noqa: E402

from difrl.rollout import rollout  # noqa: E402
from difrl.train.config import load_flow_config  # noqa: E402
from difrl.train.reward_stage import build_rewards  # noqa: E402
from difrl.worlds import build_world  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORLDS = {  # config, overrides, candidates, preview steps, the trained rollout's kernel
    "digits": (ROOT / "configs" / "digits_solrl.yaml", [], 64, 6, "ode"),
    "moving digits": (ROOT / "configs" / "moving_digits.yaml", [], 32, 4, None),
}


def rewards_of(policy, rewards, weights, x, prompts) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted reward [B], the attribute flag 'correct' [B]) of latents x."""
    out = {}
    videos = policy.decode(x)
    for name, fn in rewards.items():
        out[name] = fn(videos, prompts)
    total = sum(w * out[k][k].float() for k, w in weights.items())
    key = "motion_direction" if "motion_direction" in out else next(iter(out))
    return total, out[key]["correct"].float()


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = a.argsort().argsort().float(), b.argsort().argsort().float()
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


def group_stats(r: torch.Tensor, c: torch.Tensor) -> dict:
    """r, c [P, G] -> the spread, the attribute contrast between the reward's halves, zero-attribute-spread share."""
    order = r.argsort(1, descending=True)
    cs = c.gather(1, order)
    h = r.shape[1] // 2
    return {"reward_std": float(r.std(1).mean()), "attribute_contrast": float((cs[:, :h].mean(1) - cs[:, h:].mean(1)).mean()),
            "attribute_constant_share": float(((c.max(1).values - c.min(1).values) == 0).float().mean()),
            "attribute_mean": float(c.mean())}


def measure(name: str, quick: bool) -> dict:
    path, overrides, K, steps, kernel = WORLDS[name]
    cfg = load_flow_config(path, ["threads=1", *overrides])
    world = build_world(cfg.model.kind, cfg.model.path, cfg)
    policy = world.policy
    rewards, weights = build_rewards(cfg.reward, world.default_reward)
    G = cfg.rollout.group_size
    prompts = list(world.prompts)[: (10 if quick else len(world.prompts))]
    P = len(prompts)
    seeds = torch.arange(P * K).view(P, K) * 7 + 1000003
    many = [p for p in prompts for _ in range(K)]
    with torch.no_grad():
        prev = rollout(policy, many, seeds.flatten(), world.sigmas(steps, cfg.sampler.shift), "ode")
    r_prev, _ = rewards_of(policy, rewards, weights, prev.x_final, many)
    r_prev = r_prev.view(P, K)
    desc = r_prev.argsort(1, descending=True)
    chosen = {"selected": torch.cat([desc[:, : G // 2], desc[:, K - G // 2:]], 1), "random": torch.arange(G).expand(P, G)}
    kind = kernel or cfg.sampler.kind
    sde = None if kernel is None else torch.zeros(cfg.sampler.num_steps, dtype=torch.bool)
    out = {"world": name, "prompts": P, "candidates": K, "preview_steps": steps, "group": G, "trained_kernel": kind}
    for label, idx in chosen.items():
        s = seeds.gather(1, idx).flatten()
        ps = [p for p in prompts for _ in range(G)]
        with torch.no_grad():
            regen = rollout(policy, ps, s, world.sigmas(cfg.sampler.num_steps, cfg.sampler.shift), kind,
                            cfg.sampler.kernel_kwargs() if kernel is None else {}, sde)
        r, c = rewards_of(policy, rewards, weights, regen.x_final, ps)
        st = group_stats(r.view(P, G), c.view(P, G))
        st["preview_spearman"] = float(torch.tensor([spearman(r_prev.gather(1, idx)[p], r.view(P, G)[p])
                                                     for p in range(P)]).nanmedian())
        out[label] = st
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="10 prompts per world")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    rows = [measure(n, args.quick) for n in WORLDS]
    print("world | group | reward std | attribute contrast (upper - lower half) | attribute constant | "
          "attribute mean | preview Spearman (median)")
    for r in rows:
        for label in ("random", "selected"):
            s = r[label]
            print(f"{r['world']} ({r['candidates']} candidates, {r['preview_steps']} preview steps, trained "
                  f"{r['trained_kernel']}) | {label} | {s['reward_std']:.3f} | {s['attribute_contrast']:.3f} | "
                  f"{s['attribute_constant_share']:.2f} | {s['attribute_mean']:.3f} | {s['preview_spearman']:.2f}")
    if args.json:
        write_json(args.json, rows)
    return rows


if __name__ == "__main__":
    main()

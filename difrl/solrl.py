"""Sol-RL pieces (docs/reference/specs/lowprec-and-correctors.md §1): select the trained seeds from a low-precision
candidate pool, and measure how well the candidates' rewards predict the regenerated ones.

    pool = candidate_pool(policy, rollout_copy, world.prompts, group_prompt, seed, it, 64, 16, sigmas6, score)
    pool.seeds, pool.reward                                                  # [P * G] chosen, in group order
    idx = select_indices(candidate_rewards, k=16, rule="best_worst")        # [P, N] -> [P, k]
    agree = rank_agreement(candidate_rewards_of_chosen, regenerated)         # per-prompt Spearman / Kendall

The trainer (`rollout.kind=solrl`, difrl/train/flow/trainer.py) runs stage 1 (`candidate_pool`: N seeds per
prompt through the quantized rollout copy, few deterministic steps, rewarded, `select_indices` picks
G), and regenerates exactly those seeds with the full-precision policy (stage 2) for training.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch

from difrl.rollout import rollout
from difrl.utils.rng import mix_seed

SELECT_RULES = ("best_worst", "random", "mean_deviation", "extremes_random")


def select_indices(rewards: torch.Tensor, k: int, rule: str = "best_worst", generator: torch.Generator | None = None) -> torch.Tensor:
    """Indices [P, k] (ascending per row) of the candidates to train on, from candidate rewards [P, N].

    best_worst: the ceil(k/2) highest and floor(k/2) lowest (Sol-RL's default); random: k uniformly;
    mean_deviation: the k farthest from the prompt's mean reward; extremes_random: the best, the worst and
    k - 2 others uniformly. Ties are broken by candidate index (stable sort)."""
    P, N = rewards.shape
    if not 1 <= k <= N:
        raise ValueError(f"cannot select {k} of {N} candidates per prompt")
    if rule not in SELECT_RULES:
        raise ValueError(f"unknown selection rule {rule!r}; choose one of {SELECT_RULES}")
    r = rewards.float()
    if rule == "best_worst":
        order = torch.argsort(r, dim=1, descending=True, stable=True)
        hi = -(-k // 2)
        idx = torch.cat([order[:, :hi], order[:, N - (k - hi):]], dim=1) if k - hi else order[:, :hi]
    elif rule == "mean_deviation":
        dev = (r - r.mean(1, keepdim=True)).abs()
        idx = torch.argsort(dev, dim=1, descending=True, stable=True)[:, :k]
    elif rule == "random":
        idx = torch.stack([torch.randperm(N, generator=generator)[:k] for _ in range(P)])
    else:  # extremes_random
        rows = []
        for p in range(P):
            best = int(torch.argsort(r[p], descending=True, stable=True)[0])
            worst = int(torch.argsort(r[p], stable=True)[0])
            chosen = [best] + ([worst] if worst != best and k > 1 else [])
            rest = [int(i) for i in torch.randperm(N, generator=generator) if int(i) not in chosen]
            rows.append(torch.tensor(chosen + rest[:k - len(chosen)]))
        idx = torch.stack(rows)
    return idx.sort(dim=1).values


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Average ranks (ties share the mean rank) of a 1-D tensor."""
    x = x.double()
    order = torch.argsort(x, stable=True)
    ranks = torch.empty_like(x)
    ranks[order] = torch.arange(len(x), dtype=torch.float64)
    for v in x.unique():
        tie = x == v
        if tie.sum() > 1:
            ranks[tie] = ranks[tie].mean()
    return ranks


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rho (Pearson on average ranks); nan if either side is constant."""
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = float(ra.norm() * rb.norm())
    return float((ra * rb).sum()) / den if den > 0 else float("nan")


def kendall(a: torch.Tensor, b: torch.Tensor) -> float:
    """Kendall's tau-b (ties corrected); nan if either side is constant."""
    a, b = a.double(), b.double()
    da = torch.sign(a[:, None] - a[None, :])
    db = torch.sign(b[:, None] - b[None, :])
    iu = torch.triu_indices(len(a), len(a), 1)
    sa, sb = da[iu[0], iu[1]], db[iu[0], iu[1]]
    den = float((sa.abs().sum() * sb.abs().sum()).sqrt())
    return float((sa * sb).sum()) / den if den > 0 else float("nan")


def rank_agreement(candidate: torch.Tensor, regenerated: torch.Tensor) -> dict[str, float]:
    """Per-prompt rank agreement between candidate [P, k] and regenerated [P, k] rewards of the same seeds:
    median and mean Spearman / Kendall over prompts (prompts with a constant side are left out)."""
    rho = torch.tensor([spearman(c, g) for c, g in zip(candidate, regenerated)])
    tau = torch.tensor([kendall(c, g) for c, g in zip(candidate, regenerated)])
    out = {}
    for name, v in (("spearman", rho), ("kendall", tau)):
        v = v[~v.isnan()]
        out[f"{name}_median"] = float(v.quantile(0.5)) if len(v) else float("nan")  # middle two averaged
        out[f"{name}_mean"] = float(v.mean()) if len(v) else float("nan")
    return out


@dataclass
class CandidatePool:
    seeds: torch.Tensor  # [P * G] the chosen candidates' seeds, in group order (all processes)
    reward: torch.Tensor  # [P * G] their stage-1 rewards
    size: int  # P * N candidates sampled (all processes)


def candidate_pool(policy, rollout_copy, prompts: list[str], group_prompt: torch.Tensor, seed: int, iteration: int,
                   candidates: int, group_size: int, preview_sigmas: torch.Tensor,
                   score: Callable[[torch.Tensor, list[str], torch.Tensor, torch.Tensor], torch.Tensor],
                   select: str = "best_worst", guidance: float = 1.0, batch: int | None = None, rank: int = 0,
                   world_size: int = 1, gather: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> CandidatePool:
    """Sol-RL stage 1 (docs/reference/specs/lowprec-and-correctors.md §1.2). Candidate c of prompt group p (global index
    p * N + c, split over processes in contiguous slices) gets seed mix_seed(seed, iteration, 6, index) and is
    sampled by the rollout copy (the policy itself when rollout_copy is None) with the deterministic solver
    over `preview_sigmas`. `score(images, prompts, prompt_ids, seeds) -> [n]` rewards them (a failed candidate
    should score -inf: it then ranks last); rewards are gathered and `select` picks `group_size` per prompt.
    `prompts` are all prompts by id; group_prompt [P] is each group's prompt id."""
    P, N = len(group_prompt), candidates
    per = P * N // world_size
    c = torch.arange(rank * per, (rank + 1) * per)
    prompt_ids = group_prompt[c // N]
    seeds = torch.tensor([mix_seed(seed, iteration, 6, int(i)) for i in c])
    texts = [prompts[i] for i in prompt_ids.tolist()]
    ode = torch.zeros(len(preview_sigmas) - 1, dtype=torch.bool)
    with rollout_copy.active(policy) if rollout_copy is not None else nullcontext():
        cand = rollout(policy, texts, seeds, preview_sigmas, "ode", sde_mask=ode, prompt_ids=prompt_ids,
                       guidance=guidance, batch_size=batch)
    total = gather(score(policy.decode(cand.x_final), texts, prompt_ids, seeds)).view(P, N)  # global candidate order
    idx = select_indices(total, group_size, select, torch.Generator().manual_seed(mix_seed(seed, iteration, 8)))
    chosen = (torch.arange(P)[:, None] * N + idx).flatten()  # [P * G] global candidate indices, group order
    chosen_seeds = torch.tensor([mix_seed(seed, iteration, 6, int(i)) for i in chosen])
    return CandidatePool(chosen_seeds, total.flatten()[chosen], P * N)

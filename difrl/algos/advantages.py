"""Group-relative advantages (DESIGN.md seam 5; flow-grpo-family.md §2.7, §8.3).

    adv = group_advantages({"digit_prob": r}, {"digit_prob": 1.0}, group_ids)
    adv.advantages, adv.zero_spread          # [N] float, [N] bool (samples of zero-spread groups)

Groups are keyed by the explicit `group_ids` carried with each sample, never by prompt text.
A_i = (r_i - mean_group) / (std + eps), std over the group (``std_scope="group"``, population
std as Flow-GRPO's tracker) or over the whole gathered batch (``"global"``, Flow-GRPO's default),
then clipped to [-clip, clip]. A group whose rewards are all equal carries no learning signal;
it is flagged so that the trainer drops it and counts it in the log.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Advantages:
    advantages: torch.Tensor  # [N]
    zero_spread: torch.Tensor  # [N] bool
    reward: torch.Tensor  # [N] the aggregated reward (weighted sum)

    def stats(self) -> dict[str, float]:
        a = self.advantages
        return {"adv_mean": float(a.mean()), "adv_std": float(a.std(unbiased=False)), "adv_abs_max": float(a.abs().max()),
                "zero_spread_frac": float(self.zero_spread.float().mean())}


def group_normalize(rewards: torch.Tensor, group_ids: torch.Tensor, std_scope: str = "group", eps: float = 1e-4,
                    clip: float | None = 5.0) -> tuple[torch.Tensor, torch.Tensor]:
    """rewards [N], group_ids [N] -> (advantages [N], zero_spread [N] bool)."""
    rewards = rewards.double()
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    G = len(uniq)
    count = torch.zeros(G, dtype=torch.float64).index_add_(0, inv, torch.ones_like(rewards))
    mean = torch.zeros(G, dtype=torch.float64).index_add_(0, inv, rewards) / count
    centred = rewards - mean[inv]
    var_g = torch.zeros(G, dtype=torch.float64).index_add_(0, inv, centred**2) / count
    rmax = torch.full((G,), -torch.inf, dtype=torch.float64).scatter_reduce(0, inv, rewards, "amax")
    rmin = torch.full((G,), torch.inf, dtype=torch.float64).scatter_reduce(0, inv, rewards, "amin")
    zero = (rmax == rmin)[inv]
    if std_scope == "group":
        std = var_g.sqrt()[inv]
    elif std_scope == "global":
        std = rewards.std(unbiased=False).expand_as(rewards)
    else:
        raise ValueError(f"std_scope must be 'group' or 'global', got {std_scope!r}")
    adv = centred / (std + eps)
    adv = torch.where(zero, torch.zeros_like(adv), adv)
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    return adv.float(), zero


def group_advantages(rewards: dict[str, torch.Tensor], weights: dict[str, float], group_ids: torch.Tensor,
                     aggregate: str = "reward_sum", std_scope: str = "group", eps: float = 1e-4,
                     clip: float | None = 5.0) -> Advantages:
    """Multi-reward advantages: ``reward_sum`` normalises sum_k w_k r_k (Flow-GRPO); ``advantage_sum``
    sums w_k * normalise(r_k) (MixGRPO), so a reward with a small scale still moves the policy.
    A group counts as zero-spread when no reward varies inside it."""
    missing = [k for k in weights if k not in rewards]
    if missing:
        raise KeyError(f"reward weights name {missing}, but the rewards returned {sorted(rewards)}")
    total = sum(w * rewards[k].double() for k, w in weights.items()).float()
    if aggregate == "reward_sum":
        adv, zero = group_normalize(total, group_ids, std_scope, eps, clip)
    elif aggregate == "advantage_sum":
        parts = [group_normalize(rewards[k], group_ids, std_scope, eps, None) for k in weights]
        adv = sum(w * a for w, (a, _) in zip(weights.values(), parts))
        zero = torch.stack([z for _, z in parts]).all(0)
        if clip is not None:
            adv = adv.clamp(-clip, clip)
    else:
        raise ValueError(f"aggregate must be 'reward_sum' or 'advantage_sum', got {aggregate!r}")
    return Advantages(adv, zero, total)

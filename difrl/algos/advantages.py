"""Group-relative advantages (docs/architecture.md seam 5; docs/reference/specs/flow-grpo-family.md §2.7, §8.3).

    adv = group_advantages({"digit_prob": r}, {"digit_prob": 1.0}, group_ids)
    adv.advantages, adv.zero_spread          # [N] float, [N] bool (samples of zero-spread groups)

Groups are keyed by the explicit `group_ids` carried with each sample, never by prompt text.
``scale="std"``: A_i = (r_i - mean_group) / (std + eps), std over the group (``std_scope="group"``,
population std as Flow-GRPO's tracker) or over the whole gathered batch (``"global"``, Flow-GRPO's
default); ``"mean"``: A_i = r_i - mean_group (d1 / diffu-GRPO); ``"loo"``: leave-one-out
r_i - mean_{j != i} r_j = G / (G - 1) (r_i - mean_group) (coupled-GRPO). Then clipped to
[-clip, clip]. A ``baseline`` mask restricts the mean and std to some members of each group (the
on-policy ones when external rollouts join a group: ERILS' source normalisation), so an external
sample's advantage is its reward against what the policy does now. A group whose rewards are all
equal carries no learning signal; it is flagged so that the trainer drops it and counts it in the log.
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
                    clip: float | None = 5.0, scale: str = "std",
                    baseline: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """rewards [N], group_ids [N] -> (advantages [N], zero_spread [N] bool); baseline [N] bool or None (all)."""
    rewards = rewards.double()
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    G = len(uniq)
    base = torch.ones_like(rewards, dtype=torch.bool) if baseline is None else baseline.bool()
    w = base.double()  # 1 for the members that set the group's mean and std
    count = torch.zeros(G, dtype=torch.float64).index_add_(0, inv, w)
    if bool((count == 0).any()):
        raise ValueError("a group has no baseline member")
    mean = torch.zeros(G, dtype=torch.float64).index_add_(0, inv, rewards * w) / count
    centred = rewards - mean[inv]
    rmax = torch.full((G,), -torch.inf, dtype=torch.float64).scatter_reduce(0, inv, rewards, "amax")
    rmin = torch.full((G,), torch.inf, dtype=torch.float64).scatter_reduce(0, inv, rewards, "amin")
    zero = (rmax == rmin)[inv]
    if scale == "std":
        if std_scope == "group":
            var_g = torch.zeros(G, dtype=torch.float64).index_add_(0, inv, centred**2 * w) / count
            std = var_g.sqrt()[inv]
        elif std_scope == "global":
            std = rewards[base].std(unbiased=False).expand_as(rewards)
        else:
            raise ValueError(f"std_scope must be 'group' or 'global', got {std_scope!r}")
        adv = centred / (std + eps)
    elif scale == "loo":  # baseline members: the mean of the other G - 1; others: against the whole baseline
        adv = torch.where(base, centred * (count / (count - 1).clamp_min(1.0))[inv], centred)
    elif scale == "mean":
        adv = centred
    else:
        raise ValueError(f"scale must be 'std', 'mean' or 'loo', got {scale!r}")
    adv = torch.where(zero, torch.zeros_like(adv), adv)
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    return adv.float(), zero


def group_advantages(rewards: dict[str, torch.Tensor], weights: dict[str, float], group_ids: torch.Tensor,
                     aggregate: str = "reward_sum", std_scope: str = "group", eps: float = 1e-4,
                     clip: float | None = 5.0, scale: str = "std", baseline: torch.Tensor | None = None) -> Advantages:
    """Multi-reward advantages: ``reward_sum`` normalises sum_k w_k r_k (Flow-GRPO); ``advantage_sum``
    sums w_k * normalise(r_k) (MixGRPO), so a reward with a small scale still moves the policy.
    A group counts as zero-spread when no reward varies inside it."""
    missing = [k for k in weights if k not in rewards]
    if missing:
        raise KeyError(f"reward weights name {missing}, but the rewards returned {sorted(rewards)}")
    total = sum(w * rewards[k].double() for k, w in weights.items()).float()
    if aggregate == "reward_sum":
        adv, zero = group_normalize(total, group_ids, std_scope, eps, clip, scale, baseline)
    elif aggregate == "advantage_sum":
        parts = [group_normalize(rewards[k], group_ids, std_scope, eps, None, scale, baseline) for k in weights]
        adv = sum(w * a for w, (a, _) in zip(weights.values(), parts))
        zero = torch.stack([z for _, z in parts]).all(0)
        if clip is not None:
            adv = adv.clamp(-clip, clip)
    else:
        raise ValueError(f"aggregate must be 'reward_sum' or 'advantage_sum', got {aggregate!r}")
    return Advantages(adv, zero, total)

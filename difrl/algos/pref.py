"""Pref-GRPO's reward (arXiv 2508.20751; docs/guides/methods.md "Pref-GRPO"): a sample's win rate against the rest of its group.

    judge = sigmoid_judge({"digit_prob": 1.0}, tau=0.05)       # P(i > j) = sigmoid((r_i - r_j) / tau)
    w = group_win_rates(scores, group_ids, judge)             # [N] in [0, 1]; per group sum_i w_i = G / 2

A pairwise judge is a function (scores: {key: [N]}, i: [P] long, j: [P] long) -> [P] P(sample i beats sample j);
it must satisfy P(i > j) + P(j > i) = 1 (a judge that does not is symmetrised: (P(i>j) + 1 - P(j>i)) / 2).
The win rate of i in its group g of G members is w_i = 1 / (G - 1) * sum_{j in g, j != i} P(i > j); pairs are
formed inside each group only. Because every pair contributes P(i>j) + P(j>i) = 1, a group's win rates sum to
G / 2 and their mean is 1/2 whatever the rewards: the advantage that follows compares a sample with its group.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Judge = Callable[[dict, torch.Tensor, torch.Tensor], torch.Tensor]


def sigmoid_judge(weights: dict[str, float], tau: float = 0.05) -> Judge:
    """The pairwise preference of a scalar reward: r = sum_k w_k scores[k], P(i > j) = sigmoid((r_i - r_j) / tau).
    A Bradley-Terry judge: invariant to adding a constant to r; tau -> 0 gives the hard 0 / 1 (ties 1/2) comparisons
    of a binary pairwise judge."""
    if tau <= 0:
        raise ValueError(f"sigmoid_judge: tau must be > 0, got {tau}")

    def judge(scores: dict, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        r = sum(w * scores[k].double() for k, w in weights.items())
        return torch.sigmoid((r[i] - r[j]) / tau)

    return judge


def group_pairs(group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every ordered pair (i, j), i != j, of samples that share a group id: two [P] long tensors."""
    same = group_ids[:, None] == group_ids[None, :]
    same.fill_diagonal_(False)
    i, j = same.nonzero(as_tuple=True)
    return i, j


def group_win_rates(scores: dict, group_ids: torch.Tensor, judge: Judge) -> torch.Tensor:
    """[N] float32 win rates within each group (module docstring); a group of one sample gets 1/2 (no opponent)."""
    N = len(group_ids)
    i, j = group_pairs(group_ids)
    p_ij, p_ji = judge(scores, i, j).double(), judge(scores, j, i).double()
    p = 0.5 * (p_ij + 1.0 - p_ji)  # symmetrised: P(i>j) + P(j>i) = 1 exactly
    wins = torch.zeros(N, dtype=torch.float64).index_add_(0, i, p)
    opponents = torch.zeros(N, dtype=torch.float64).index_add_(0, i, torch.ones_like(p))
    return torch.where(opponents > 0, wins / opponents.clamp_min(1.0), torch.full_like(wins, 0.5)).float()

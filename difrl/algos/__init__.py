"""Advantages and losses (docs/architecture.md seam 5)."""

from difrl.algos.advantages import Advantages, group_advantages, group_normalize
from difrl.algos.guard import ratio_norm_log_ratio, step_weights
from difrl.algos.losses import gaussian_step_kl, k3_kl, ppo_clip_loss
from difrl.algos.tree import (depth_prune, depth_pruning_set, depthwise_advantages, edge_advantages, fuse_rewards,
                              width_prune)

__all__ = ["Advantages", "group_advantages", "group_normalize", "gaussian_step_kl", "k3_kl", "ppo_clip_loss", "ratio_norm_log_ratio", "step_weights",
           "depth_prune", "depth_pruning_set", "depthwise_advantages", "edge_advantages", "fuse_rewards", "width_prune"]

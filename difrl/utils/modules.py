"""Swapping the network an adapter runs.

    with use_module(policy, reference):      # policy.velocity / policy.logits run `reference` inside the block
        v_ref = policy.velocity(x, sigma, cond)

Every adapter (difrl.models, difrl.discrete) keeps its network in `.module`; this is the one place that
attribute is swapped (the frozen reference of full fine-tuning, a quantized rollout copy, a merged
checkpoint being saved). It lives with the leaves so that difrl.quant can run a policy on its rollout copy
without importing the adapters above it.
"""

from __future__ import annotations

from contextlib import contextmanager

from torch import nn


@contextmanager
def use_module(policy, module: nn.Module):
    """Run `policy` (anything with a `.module`) with `module` as its network inside the block; restored on exit,
    also when the block raises."""
    saved = policy.module
    policy.module = module
    try:
        yield module
    finally:
        policy.module = saved

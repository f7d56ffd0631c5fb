"""Swapping the network an adapter runs, and what every layer asks of a network.

    with use_module(policy, reference):      # policy.velocity / policy.logits run `reference` inside the block
        v_ref = policy.velocity(x, sigma, cond)
    params = trainable_params(net)           # {name: parameter} of the trained ones (requires_grad)
    base = peft_base(net)                    # the model under a peft wrapper (LoRA layers injected), else net

Every adapter (difrl.models, difrl.discrete) keeps its network in `.module`; this is the one place that
attribute is swapped (the frozen reference of full fine-tuning, a quantized rollout copy, a merged
checkpoint being saved). It lives with the leaves so that difrl.quant can run a policy on its rollout copy
without importing the adapters above it. `trainable_params` and `peft_base` live here for the same reason: the
rollout copy's sync (difrl.quant) and the trainer's checkpoints (difrl.train) read a network the same way.
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


def trainable_params(module: nn.Module) -> dict[str, nn.Parameter]:
    """The trained parameters of `module` by name (those with requires_grad), in named_parameters' order."""
    return {k: p for k, p in module.named_parameters() if p.requires_grad}


def peft_base(module: nn.Module) -> nn.Module:
    """The model under a peft wrapper (PeftModel -> its base model with LoRA layers injected); else `module`."""
    return module.get_base_model() if hasattr(module, "get_base_model") else module

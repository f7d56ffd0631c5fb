"""Differentiable scoring for reward backpropagation (DRaFT / ReFL, difrl/train/flow/reward_backprop.py).

    fn = build_reward("digit_prob")                # fn.differentiable: declared by its factory
    r = score_with_grad(fn, images, prompts)      # [B] float32 on the images' device, with a graph to `images`
    differentiable("ocr")                          # False: the config refuses it for train.objective=draft / refl

The ordinary path (difrl.rewards.Reward.__call__) scores under inference mode and returns detached CPU scores;
this one keeps the graph, so it runs in the caller's thread (no reward.timeout: the backward must follow here).
"""

from __future__ import annotations

import torch

from difrl.rewards import Reward, RewardContractError, differentiable  # noqa: F401  (re-exported)


def score_with_grad(reward: Reward, samples: torch.Tensor, prompts: list[str],
                    metadata: list[dict] | None = None) -> torch.Tensor:
    """The main score [B] float32 on the samples' device WITH its graph to `samples`, in chunks of the reward's
    batch_size on its device (``.to`` keeps the graph). Only for a reward that declares ``differentiable``; a score
    that comes back without a graph while `samples` requires grad is a RewardContractError (a detach hidden in the
    reward), as is one of the wrong shape."""
    if not reward.differentiable:
        raise RewardContractError(f"reward {reward.name!r} does not declare a differentiable score (differentiable = "
                                  "True on its factory); reward backpropagation cannot use it")
    reward._check(samples)
    B = len(prompts)
    metadata = metadata if metadata is not None else [{} for _ in range(B)]
    bs = reward.batch_size or max(B, 1)
    parts = []
    for lo in range(0, B, bs):
        n = min(bs, B - lo)
        chunk = samples[lo:lo + bs]
        chunk = chunk.to(device=reward.device or chunk.device, dtype=reward.dtype or chunk.dtype)
        res = reward.fn(chunk, prompts[lo:lo + bs], metadata[lo:lo + bs])
        score = res[reward.own_key] if isinstance(res, dict) else res
        if not torch.is_tensor(score) or tuple(score.shape) != (n,):
            raise RewardContractError(f"reward {reward.name!r} returned {type(score).__name__} "
                                      f"{tuple(getattr(score, 'shape', ()))} as its score for {n} samples")
        parts.append(score.to(device=samples.device, dtype=torch.float32))
    out = torch.cat(parts) if parts else samples.new_zeros(0)
    if samples.requires_grad and torch.is_grad_enabled() and not out.requires_grad:
        raise RewardContractError(f"reward {reward.name!r} declares a differentiable score but returned one without a "
                                  "graph to the samples (a torch.no_grad or .detach() inside it)")
    return out

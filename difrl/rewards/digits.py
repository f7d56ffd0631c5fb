"""The digits world's rewards: p(prompted digit) under the bundled CNN classifier, and its logit margin.

    fn = build_reward("digit_prob")                 # options: classifier_path=...
    fn(images [B, 1, 8, 8], ["a handwritten 3", ...], metadata)["digit_prob"]   # [B] in [0, 1]
"""

from __future__ import annotations

import torch

from difrl.models.digits import NULL_LABEL, parse_digit_prompt
from difrl.rewards import register_reward


@register_reward("digit_prob")
def digit_prob(classifier_path: str | None = None):
    from difrl.worlds.digits import load_classifier

    clf = load_classifier(classifier_path)

    @torch.no_grad()
    def score(images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> dict[str, torch.Tensor]:
        labels = torch.tensor([parse_digit_prompt(p) for p in prompts])
        if (labels == NULL_LABEL).any():
            raise ValueError("digit_prob needs a digit in every prompt")
        probs = torch.softmax(clf(images.float()), dim=-1)
        return {"digit_prob": probs[torch.arange(len(labels)), labels], "correct": (probs.argmax(-1) == labels).float()}

    return score


@register_reward("digit_margin")
def digit_margin(classifier_path: str | None = None):
    """The classifier's logit margin: logit(prompted digit) - max of the other logits. Unbounded where
    digit_prob saturates at 1, so search and best-of-N keep a measurable difference (benchmarks/bench_dts.py)."""
    from difrl.worlds.digits import load_classifier

    clf = load_classifier(classifier_path)

    @torch.no_grad()
    def score(images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> dict[str, torch.Tensor]:
        labels = torch.tensor([parse_digit_prompt(p) for p in prompts])
        if (labels == NULL_LABEL).any():
            raise ValueError("digit_margin needs a digit in every prompt")
        logits = clf(images.float())
        target = logits[torch.arange(len(labels)), labels]
        others = logits.scatter(1, labels[:, None], -torch.inf).amax(1)
        return {"digit_margin": target - others, "correct": (logits.argmax(-1) == labels).float()}

    return score

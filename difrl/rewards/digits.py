"""The digits world's rewards: p(prompted digit) under the bundled CNN classifier, and its logit margin.

    fn = build_reward("digit_prob")                 # options: classifier_path=...
    fn(images [B, 1, 8, 8], ["a handwritten 3", ...], metadata)["digit_prob"]   # [B] in [0, 1]
    clf = load_classifier()                         # the reward model itself (the digits worlds' FD features too)

The classifier lives here, with the rewards that use it; the digits and digit-tokens worlds import it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from difrl.models.digits import NULL_LABEL, parse_digit_prompt
from difrl.rewards import register_reward

BUNDLED_CLASSIFIER = Path(__file__).resolve().parent.parent / "assets" / "digits_classifier.safetensors"


class DigitClassifier(nn.Module):
    """Small CNN: [B, 1, 8, 8] in [0, 1] -> logits [B, 10]; `features` is the 64-d penultimate layer."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.fc = nn.Linear(64 * 2 * 2, 64)
        self.head = nn.Linear(64, 10)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(self.conv(images).flatten(1)))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


def load_classifier(path: str | Path | None = None) -> DigitClassifier:
    from difrl.utils.io import load_safetensors_checked

    path = Path(path) if path else BUNDLED_CLASSIFIER
    tensors, _ = load_safetensors_checked(path, what="digits classifier checkpoint")
    clf = DigitClassifier()
    missing, unexpected = clf.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path} is not a digits classifier checkpoint: missing {missing[:4]}, unexpected {unexpected[:4]}")
    return clf.eval().requires_grad_(False)


@register_reward("digit_prob")
def digit_prob(classifier_path: str | None = None):
    """p(prompted digit) under the digits classifier (the digits worlds' reward), plus `correct` (argmax = digit)."""
    clf = load_classifier(classifier_path)

    # no torch.no_grad here: difrl.rewards.Reward scores under inference mode, and reward backpropagation
    # (Reward.score_grad) needs the graph from the images to p(digit); the classifier's weights stay frozen
    def score(images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> dict[str, torch.Tensor]:
        labels = torch.tensor([parse_digit_prompt(p) for p in prompts], device=images.device)
        if (labels == NULL_LABEL).any():
            raise ValueError("digit_prob needs a digit in every prompt")
        probs = torch.softmax(clf(images.float()), dim=-1)
        return {"digit_prob": probs[torch.arange(len(labels)), labels], "correct": (probs.argmax(-1) == labels).float()}

    return score


digit_prob.differentiable = True  # a factory's declaration (difrl.rewards.differentiable reads it unbuilt)


@register_reward("digit_margin")
def digit_margin(classifier_path: str | None = None):
    """The classifier's logit margin: logit(prompted digit) - max of the other logits. Unbounded where
    digit_prob saturates at 1, so search and best-of-N keep a measurable difference (benchmarks/bench_dts.py)."""
    clf = load_classifier(classifier_path)

    def score(images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> dict[str, torch.Tensor]:
        labels = torch.tensor([parse_digit_prompt(p) for p in prompts], device=images.device)
        if (labels == NULL_LABEL).any():
            raise ValueError("digit_margin needs a digit in every prompt")
        logits = clf(images.float())
        target = logits[torch.arange(len(labels)), labels]
        others = logits.scatter(1, labels[:, None], -torch.inf).amax(1)
        return {"digit_margin": target - others, "correct": (logits.argmax(-1) == labels).float()}

    return score


digit_margin.differentiable = True

"""Masked-diffusion worlds: what the masked GRPO trainer needs from a bundled discrete task.

    world = build_masked_world(cfg)                  # difrl.worlds: cfg (a MaskedConfig).model.kind picks the world
    batch = world.prompts(16, seed)                  # MaskedPrompts: start tokens, cond, prompt texts, metadata
    samples = world.decode(out.tokens)               # what rewards score (Sudoku: digits; digit tokens: images)
    scores = score_all(rewards, samples, batch.texts, batch.metadata, seeds, prompt_ids)   # difrl.rewards
    metrics = world.evaluate(world.policy)           # the world's fixed evaluation (summary.json keys)

Rewards are scored through the one reward registry (difrl.rewards), like the flow worlds', so
``module:function`` plug-ins, multi-reward weights and ``reward.on_error`` work here too; a reward
gets ``world.decode(tokens)``, the prompt texts and each sample's metadata. This file holds the two types;
each world's file has its builder ``masked_world(cfg) -> MaskedWorld``, and a plain dict in difrl/worlds/__init__.py
(``MASKED_WORLDS``) maps ``model.kind`` to it. Three worlds:

- ``sudoku`` (difrl/worlds/sudoku.py): prompt = the puzzle's givens (token positions that are
  never masked; text "12.4/..3./...." row by row, "." = blank), samples = filled digits [N, 16],
  metadata ``{"puzzle": [16]}``; reward ``sudoku_cells``; eval keys ``cell_accuracy`` and ``solve_rate``.
- ``digit_tokens`` (difrl/worlds/digit_tokens.py): prompt = the digit label (``cond["label"]``, no
  token position is prompt; text "a handwritten 3"), samples = images [N, 1, 8, 8] in [0, 1],
  metadata ``{"digit": d}``; reward ``digit_prob`` (the flow digits world's); eval keys those of the
  flow digits world (``accuracy``, ``fd``, ...).
- ``hf_masked`` (difrl/worlds/text_tasks.py): any local transformers masked LM on a text task (model.task),
  prompt = the question in the chat template, left-padded; samples = completions as text cut at EOS;
  metadata = the problem; reward ``text_correct`` (+ ``text_format``); eval keys ``pass@k``, ``greedy_accuracy``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from difrl.eval.passk import Verifier
from difrl.worlds.contract import before_after_keys, format_eval, save_merged_and_adapter


@dataclass
class MaskedPrompts:
    """n prompts of a masked world (rows of every tensor and list are samples)."""
    tokens: torch.Tensor  # [n, L] long: the rollout's start (mask id at every position to generate)
    cond: dict  # "prompt_mask" [n, L] bool (+ "label" [n] long for label-conditioned worlds)
    texts: list[str]  # the prompt as text, what a reward reads (Sudoku: the puzzle; digit tokens: "a handwritten 3")
    metadata: list[dict]  # per-sample reward metadata (Sudoku: {"puzzle": [16]}; digit tokens: {"digit": d})
    ids: torch.Tensor | None = None  # [n] long: each prompt's id in the world's prompt table, what a reward error
    # names (Sudoku: the index of the puzzle's source solution grid; digit tokens: the digit; hf_masked: the line of
    # the training problems); None: the prompts have no table (fixed evaluation sets)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def repeat(self, g: int) -> "MaskedPrompts":
        """Each prompt g times in a row: sample k belongs to group k // g."""
        rep = lambda t: t.repeat_interleave(g, dim=0)
        return MaskedPrompts(rep(self.tokens), {k: rep(v) for k, v in self.cond.items()},
                             [t for t in self.texts for _ in range(g)], [m for m in self.metadata for _ in range(g)],
                             None if self.ids is None else rep(self.ids))

    def select(self, idx: torch.Tensor) -> "MaskedPrompts":
        rows = idx.tolist()
        return MaskedPrompts(self.tokens[idx], {k: v[idx] for k, v in self.cond.items()},
                             [self.texts[i] for i in rows], [self.metadata[i] for i in rows],
                             None if self.ids is None else self.ids[idx])

    @property
    def prompt(self) -> torch.Tensor:
        return self.cond["prompt_mask"]

    @property
    def model_cond(self) -> dict | None:
        """cond without the prompt mask (what policy.logits needs), None if nothing is left."""
        rest = {k: v for k, v in self.cond.items() if k != "prompt_mask"}
        return rest or None


@dataclass
class MaskedWorld:
    name: str
    policy: object  # a MaskedPolicy
    prompts: Callable[[int, int], MaskedPrompts]  # (n, seed) -> n training prompts, a pure function of seed
    decode: Callable[[torch.Tensor], torch.Tensor]  # tokens [N, L] -> the samples rewards score
    default_reward: str  # the reward of reward.weights=null
    evaluate: Callable[[object], dict]  # policy -> the world's fixed evaluation
    headline: tuple[str, ...]  # eval keys shown in the progress bar, the CLI table and the plot
    load_policy: Callable[[str | Path | None], object]  # checkpoint path (None = bundled base) -> a policy
    save_samples: Callable[[object, Path], None] | None = None  # (policy, png path): a picture of the eval samples
    external: dict[str, Callable] = field(default_factory=dict)  # ERILS sources without a checkpoint: name -> sampler
    verifier: Verifier | None = None  # the default pass@k set and check (difrl eval --pass-k); None: none
    parse_prompts: Callable[[list[str]], MaskedPrompts] | None = None  # prompt texts -> prompts (difrl sample --prompt);
    # None: the world takes no prompt typed by hand
    show: Callable[[object], list[str]] | None = None  # decoded samples -> one line of text each (difrl sample);
    # None: samples that are text already (hf_masked) or pictures (save_samples)
    # (policy, net, lora, out_dir, write_merged): the final weights (difrl.worlds.contract); the default:
    # policy.safetensors, LoRA merged, and under LoRA the adapter alone as peft's lora/
    save_final: Callable[..., None] = save_merged_and_adapter
    # eval metrics -> the line the trainer prints; None: the headline keys (contract.format_eval)
    describe_eval: Callable[[dict], str] | None = None
    # eval keys difrl train's before / after table lists first, in this order; the headline keys follow (as World's)
    before_after: tuple[str, ...] = ()

    def eval_line(self, ev: dict) -> str:
        return self.describe_eval(ev) if self.describe_eval is not None else format_eval(ev, self.headline)

    def before_after_keys(self) -> list[str]:
        return before_after_keys(self.before_after, self.headline)


__all__ = ["MaskedPrompts", "MaskedWorld"]

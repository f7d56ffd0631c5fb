"""Masked-diffusion worlds: what the masked GRPO trainer needs from a bundled discrete task.

    world = build_masked_world(cfg)                  # cfg: a MaskedConfig; cfg.model.kind picks the world
    batch = world.prompts(16, seed)                  # MaskedPrompts: start tokens, cond, prompt texts, metadata
    samples = world.decode(out.tokens)               # what rewards score (Sudoku: digits; digit tokens: images)
    scores = score_all(rewards, samples, batch.texts, batch.metadata, seeds, prompt_ids)   # difrl.rewards
    metrics = world.evaluate(world.policy)           # the world's fixed evaluation (summary.json keys)

Rewards are scored through the one reward registry (difrl.rewards), like the flow worlds', so
``module:function`` plug-ins, multi-reward weights and ``reward.on_error`` work here too; a reward
gets ``world.decode(tokens)``, the prompt texts and each sample's metadata. A plain dict
(``MASKED_WORLDS``) maps ``model.kind`` to a builder ``cfg -> MaskedWorld``. Three worlds:

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


def _sudoku(cfg) -> MaskedWorld:
    from difrl.worlds import sudoku

    def prompts(n: int, seed: int) -> MaskedPrompts:
        puzzles, grids = sudoku.sample_training_puzzles(n, tuple(cfg.rollout.num_blanks), seed=seed)
        tokens, prompt = sudoku.encode(puzzles)
        ids = (grids[:, None, :] == sudoku.solutions()[None]).all(-1).int().argmax(1)  # [n] source grid's row
        return MaskedPrompts(tokens, {"prompt_mask": prompt}, [sudoku.puzzle_text(p) for p in puzzles],
                             [{"puzzle": p} for p in puzzles], ids)

    def evaluate(policy) -> dict:
        return sudoku.evaluate_sudoku(policy, cfg.eval.num_blanks, cfg.eval.count, seed=cfg.eval.seed)[0]

    return MaskedWorld("sudoku", sudoku.load_base(cfg.model.path), prompts, sudoku.decode, "sudoku_cells", evaluate,
                       ("cell_accuracy", "solve_rate"), sudoku.load_base, external={"solver": sudoku.solver_sample})


def _digit_tokens(cfg) -> MaskedWorld:
    from difrl.models.digits import digit_prompt
    from difrl.worlds import digit_tokens as dt
    from difrl.worlds.digits import DigitsWorld

    images_world = DigitsWorld.load()

    def prompts(n: int, seed: int) -> MaskedPrompts:
        labels = dt.sample_training_labels(n, seed)
        tokens, cond = dt.start_tokens(labels)
        return MaskedPrompts(tokens, cond, [digit_prompt(d) for d in labels.tolist()],
                             [{"digit": d} for d in labels.tolist()], labels)

    def evaluate(policy) -> dict:
        return dt.evaluate_digit_tokens(policy, images_world, cfg.eval.per_digit, seed=cfg.eval.seed)[0]

    def save_samples(policy, path: Path) -> None:
        _, images = dt.evaluate_digit_tokens(policy, images_world, min(cfg.eval.per_digit, 10), seed=cfg.eval.seed)
        dt.save_grid(images, path)

    return MaskedWorld("digit_tokens", dt.load_base(cfg.model.path), prompts, dt.tokens_to_images, "digit_prob",
                       evaluate, ("accuracy", "fd"), dt.load_base, save_samples)


def _hf_masked(cfg) -> MaskedWorld:
    from difrl.worlds.text_tasks import build_text_world

    return build_text_world(cfg)


MASKED_WORLDS: dict[str, Callable[..., MaskedWorld]] = {"sudoku": _sudoku, "digit_tokens": _digit_tokens,
                                                        "hf_masked": _hf_masked}
MASKED_KINDS = tuple(MASKED_WORLDS)  # the model.kind values the masked trainer runs (difrl/train/masked_config.py)


def build_masked_world(cfg) -> MaskedWorld:
    kind = cfg.model.kind
    if kind not in MASKED_WORLDS:
        raise ValueError(f"unknown masked model.kind {kind!r}; known: {', '.join(MASKED_WORLDS)}")
    return MASKED_WORLDS[kind](cfg)


__all__ = ["MASKED_KINDS", "MASKED_WORLDS", "MaskedPrompts", "MaskedWorld", "build_masked_world"]

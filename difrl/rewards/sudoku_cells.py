"""The 4x4 Sudoku verifier as a reward: the fraction of a puzzle's blanks filled without a conflict.

    fn = build_reward("sudoku_cells")
    fn(filled [B, 16] digits 1..4 (0 = empty), prompts, [{"puzzle": [16] long, 0 = blank}, ...])
    # {"sudoku_cells": [B] fp32 in [0, 1], "solved": [B] 0/1}

It checks *validity*, not equality with the grid the puzzle was cut from (a puzzle with many blanks
has several solutions): a filled blank scores when no other cell of its row, column or 2x2 box holds
the same digit; solved = the whole grid is valid. The givens are taken from the puzzle whatever the
sample holds there. The Sudoku world (difrl/worlds/sudoku.py) decodes tokens to digits and puts each
puzzle in its sample's metadata.
"""

from __future__ import annotations

import torch

from difrl.rewards import register_reward

SIZE, CELLS = 4, 16


def _peers() -> torch.Tensor:
    """[16, 16] bool: cells sharing a row, column or 2x2 box (a cell is not its own peer)."""
    r, c = torch.arange(CELLS) // SIZE, torch.arange(CELLS) % SIZE
    b = (r // 2) * 2 + c // 2
    same = (r[:, None] == r[None]) | (c[:, None] == c[None]) | (b[:, None] == b[None])
    return same & ~torch.eye(CELLS, dtype=torch.bool)


PEERS = _peers()


def cell_valid(grid: torch.Tensor) -> torch.Tensor:
    """[N, 16] digits -> [N, 16] bool: the cell holds 1..4 and no peer holds the same digit."""
    same = (grid[:, :, None] == grid[:, None, :]) & PEERS[None]
    return (grid >= 1) & (grid <= SIZE) & ~same.any(-1)


def sudoku_reward(filled: torch.Tensor, puzzles: torch.Tensor) -> torch.Tensor:
    """[N] fp32: fraction of the puzzle's blanks filled with a digit that conflicts with no peer.
    The givens are taken from the puzzle whatever `filled` holds there."""
    blank = puzzles == 0
    grid = torch.where(blank, filled, puzzles)
    return (cell_valid(grid) & blank).sum(1).float() / blank.sum(1).clamp_min(1).float()


def solved(filled: torch.Tensor, puzzles: torch.Tensor) -> torch.Tensor:
    """[N] bool: the completed grid is a valid Sudoku (every cell valid)."""
    return cell_valid(torch.where(puzzles == 0, filled, puzzles)).all(1)


@register_reward("sudoku_cells")
def sudoku_cells():
    """Fraction of blanks filled validly (the training reward of configs/sudoku.yaml), plus `solved`."""

    @torch.no_grad()
    def score(filled: torch.Tensor, prompts: list[str], metadata: list[dict]) -> dict[str, torch.Tensor]:
        if filled.ndim != 2 or filled.shape[1] != CELLS:
            raise ValueError(f"sudoku_cells scores filled grids [B, {CELLS}] of digits, got {tuple(filled.shape)}")
        if metadata is None or any("puzzle" not in m for m in metadata):
            raise ValueError("sudoku_cells needs each sample's puzzle in its metadata ({'puzzle': [16] long})")
        puzzles = torch.stack([torch.as_tensor(m["puzzle"]) for m in metadata])
        return {"sudoku_cells": sudoku_reward(filled, puzzles), "solved": solved(filled, puzzles).float()}

    return score

"""The 4x4 Sudoku world: every solution grid, a split by solution, puzzles, tokens, reward, eval.

    grids = solutions()                                   # [288, 16] digits 1..4, row-major
    split = solution_split()                              # {"train": [200] ids, "test": [88] ids}, fixed
    puzzles = make_puzzles(grids[split["test"]], num_blanks=8, seed=0)   # 0 = blank
    tokens, prompt = encode(puzzles)                      # [N, 16]: digit - 1 at givens, MASK_ID at blanks
    r = sudoku_reward(decode(out.tokens), puzzles)        # [N] fraction of blanks filled without conflict
    metrics, filled = evaluate_sudoku(policy)             # {"cell_accuracy", "solve_rate", ...} on the test split
    world = masked_world(cfg)                             # the MaskedWorld of model.kind=sudoku (cfg: a MaskedConfig)

Tokens: one per cell in row-major order; vocabulary {digit 1..4 -> ids 0..3, MASK_ID = 4}. The
prompt is the puzzle (its givens, never masked or changed); the answer positions are the blanks,
which a rollout starts as MASK_ID. The reward checks *validity*, not equality with the grid the
puzzle was cut from (a puzzle with many blanks has several solutions): a filled blank scores when
no other cell of its row, column or 2x2 box holds the same digit. Solve = the whole grid is valid.
The split is by solution grid (as SPG's solution-disjoint split), so no test solution is ever seen
in training.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from difrl.rewards.sudoku_cells import CELLS, PEERS, SIZE, cell_valid, solved, sudoku_reward  # noqa: F401  (the verifier)
from difrl.eval.passk import Verifier
from difrl.utils.rng import mix_seed
from difrl.worlds.masked import MaskedPrompts, MaskedWorld
from difrl.worlds.contract import format_eval

ASSETS = Path(__file__).resolve().parent.parent / "assets"
BUNDLED_BASE = ASSETS / "sudoku_base.safetensors"
VOCAB, MASK_ID = 5, 4
SPLIT_SEED, N_TEST_SOLUTIONS = 7, 88  # 200 train / 88 test solution grids
EVAL_BLANKS, EVAL_PUZZLES, EVAL_SEED = 8, 256, 1234


@lru_cache(maxsize=1)
def solutions() -> torch.Tensor:
    """All 288 valid 4x4 Sudoku grids, [288, 16] long digits 1..4, in lexicographic order."""
    peers = [PEERS[i].nonzero().flatten().tolist() for i in range(CELLS)]
    out, grid = [], [0] * CELLS

    def fill(i: int) -> None:
        if i == CELLS:
            out.append(list(grid))
            return
        for d in range(1, SIZE + 1):
            if all(grid[j] != d for j in peers[i] if j < i):
                grid[i] = d
                fill(i + 1)
        grid[i] = 0

    fill(0)
    return torch.tensor(out, dtype=torch.long)


@lru_cache(maxsize=4)
def solution_split(seed: int = SPLIT_SEED, n_test: int = N_TEST_SOLUTIONS) -> dict[str, torch.Tensor]:
    """Fixed split of the 288 solution ids: {"train": sorted ids, "test": sorted ids}, disjoint."""
    perm = torch.randperm(len(solutions()), generator=torch.Generator().manual_seed(mix_seed(seed)))
    return {"train": perm[n_test:].sort().values, "test": perm[:n_test].sort().values}


def make_puzzles(grids: torch.Tensor, num_blanks: int | tuple[int, int], seed: int) -> torch.Tensor:
    """Blank out cells of each grid ([N, 16] digits): `num_blanks` cells, or a count drawn uniformly
    from the inclusive range (lo, hi) per puzzle, chosen uniformly. Returns [N, 16], 0 = blank."""
    gen = torch.Generator().manual_seed(mix_seed(seed))
    n = len(grids)
    if isinstance(num_blanks, int):
        counts = torch.full((n,), num_blanks, dtype=torch.long)
    else:
        lo, hi = num_blanks
        counts = torch.randint(lo, hi + 1, (n,), generator=gen)
    if int(counts.min()) < 1 or int(counts.max()) > CELLS:
        raise ValueError(f"num_blanks must lie in 1..16, got {num_blanks}")
    rank = torch.rand(n, CELLS, generator=gen).argsort(1).argsort(1)  # a random permutation rank per cell
    return grids.masked_fill(rank < counts[:, None], 0)


def sample_training_puzzles(n: int, num_blanks: int | tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n puzzles cut from random *train* solutions: (puzzles [n, 16], their source grids [n, 16])."""
    train = solution_split()["train"]
    gen = torch.Generator().manual_seed(mix_seed(seed, 1))
    grids = solutions()[train[torch.randint(0, len(train), (n,), generator=gen)]]
    return make_puzzles(grids, num_blanks, mix_seed(seed, 2)), grids


@lru_cache(maxsize=8)
def test_puzzles(num_blanks: int | tuple[int, int] = EVAL_BLANKS, count: int = EVAL_PUZZLES,
                 seed: int = EVAL_SEED) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed evaluation set: `count` puzzles cut from the test solutions, cycling through them.
    Returns (puzzles [count, 16], source grids [count, 16])."""
    test = solution_split()["test"]
    grids = solutions()[test[torch.arange(count) % len(test)]]
    return make_puzzles(grids, num_blanks, seed), grids


def encode(puzzles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Puzzles [N, 16] (0 = blank) -> (tokens [N, 16] with MASK_ID at blanks, prompt mask [N, 16] bool)."""
    prompt = puzzles > 0
    return torch.where(prompt, puzzles - 1, torch.full_like(puzzles, MASK_ID)), prompt


def puzzle_text(puzzle: torch.Tensor) -> str:
    """A puzzle [16] (0 = blank) as text, row by row: "12.4/..3./4.../...1" with "." for a blank."""
    cells = ["." if int(d) == 0 else str(int(d)) for d in puzzle.tolist()]
    return "/".join("".join(cells[r * SIZE:(r + 1) * SIZE]) for r in range(SIZE))


def parse_puzzle(text: str) -> torch.Tensor:
    """A puzzle as ``puzzle_text`` writes it ("12.4/..3./4.../...1", "." or "0" = blank) -> [16] long, 0 = blank;
    anything else raises, naming the text."""
    rows = text.strip().split("/")
    cells = "".join(rows)
    if len(rows) != SIZE or any(len(r) != SIZE for r in rows) or any(c not in ".01234" for c in cells):
        raise ValueError(f"not a 4x4 Sudoku puzzle: {text!r}; write its rows with '/' between them and '.' for a blank, "
                         "e.g. '12.4/..3./4.../...1'")
    return torch.tensor([0 if c == "." else int(c) for c in cells], dtype=torch.long)


def decode(tokens: torch.Tensor) -> torch.Tensor:
    """Tokens [N, 16] -> digits [N, 16] (0 where still masked)."""
    return torch.where(tokens == MASK_ID, torch.zeros_like(tokens), tokens + 1)


def solver_sample(tokens: torch.Tensor, cond: dict | None = None, *, seeds, **_) -> "DiscreteRollout":
    """An external *policy* that always solves (ERILS' solver source): blanks are committed one per
    step in a random order; each draws uniformly among the digits that some valid completion of the
    grid so far puts there, so every rollout is a valid solution and each token's behaviour
    probability is known exactly: logp = -log(number of such digits). Seeded per sample like the
    learned samplers (``seeds`` [B] or an int); nfe = 0 (no network). Tokens [B, 16] from ``encode``."""
    from difrl.discrete.samplers import DiscreteRollout, counter_uniform, row_seeds

    seeds = row_seeds(seeds, tokens.shape[0])
    grids = solutions() - 1  # [288, 16] token ids
    x = tokens.clone()
    gen = tokens == MASK_ID
    order = counter_uniform(seeds, 21, 0, CELLS).masked_fill(~gen, 2.0).argsort(1)  # blanks first, random order
    logp = torch.zeros(tokens.shape, dtype=torch.float32)
    step = torch.full(tokens.shape, -1, dtype=torch.long)
    rows = torch.arange(tokens.shape[0])
    for s in range(int(gen.sum(1).max()) if gen.any() else 0):
        cell = order[:, s]
        active = gen[rows, cell]
        fits = ((grids[None] == x[:, None]) | (x[:, None] == MASK_ID)).all(-1)  # [B, 288] completions of the grid so far
        if not bool(fits[active].any(1).all()):
            raise ValueError("solver_sample: a puzzle has no valid completion (its givens conflict)")
        # digits that some completion puts at `cell`: count the fitting grids per digit
        allowed = torch.zeros(len(rows), SIZE, dtype=torch.long).scatter_add_(1, grids[:, cell].T, fits.long()) > 0
        count = allowed.sum(1).clamp_min(1)
        pick = (counter_uniform(seeds, 22, s, 1)[:, 0] * count).long().clamp_max(count - 1)  # uniform among allowed
        digit = (allowed.long().cumsum(1) <= pick[:, None]).sum(1)
        x[rows[active], cell[active]] = digit[active]
        logp[rows[active], cell[active]] = -torch.log(count[active].float())
        step[rows[active], cell[active]] = s
    return DiscreteRollout(x, tokens.clone(), gen, logp, logp.clone(), step, 0, torch.zeros(len(rows), dtype=torch.long), seeds)


def load_base(path: str | Path | None = None):
    """The bundled weak base (or a checkpoint at `path`) as a TinyMaskedPolicy."""
    from difrl.discrete.policy import TinyMaskedPolicy

    return TinyMaskedPolicy.from_checkpoint(Path(path) if path else BUNDLED_BASE, what="sudoku masked transformer checkpoint",
                                            expect=dict(num_labels=0, vocab_size=VOCAB, mask_id=MASK_ID, seq_len=CELLS))


def evaluate_sudoku(policy, num_blanks: int | tuple[int, int] = EVAL_BLANKS, count: int = EVAL_PUZZLES,
                    sampler: str = "llada", seed: int = EVAL_SEED, batch: int = 256, **sampler_kw) -> tuple[dict, torch.Tensor]:
    """Fill the fixed test puzzles with `policy`; default sampler: LLaDA low-confidence, one token per
    step, greedy (T = 0). Returns ({"cell_accuracy", "solve_rate", "nfe" (mean forward passes per puzzle), "num_puzzles",
    "num_blanks"},
    filled digits [count, 16])."""
    from difrl.discrete.samplers import SAMPLERS

    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}; known: {', '.join(SAMPLERS)}")
    kw = dict(steps=CELLS, temperature=0.0) if sampler == "llada" else {}
    kw |= sampler_kw
    puzzles, _ = test_puzzles(num_blanks, count, seed)
    net = policy.module
    was_training = net.training
    net.eval()
    filled, nfe = [], []
    try:
        for lo in range(0, count, batch):
            tokens, prompt = encode(puzzles[lo:lo + batch])
            out = SAMPLERS[sampler](policy, tokens, {"prompt_mask": prompt}, seeds=mix_seed(seed, lo), **kw)
            filled.append(decode(out.tokens))
            nfe.append(out.nfe_per_sample.float())
    finally:
        net.train(was_training)
    filled = torch.cat(filled)
    metrics = {"cell_accuracy": float(sudoku_reward(filled, puzzles).mean()), "solve_rate": float(solved(filled, puzzles).float().mean()),
               "nfe": float(torch.cat(nfe).mean()), "num_puzzles": count, "num_blanks": str(num_blanks)}
    return metrics, filled


def eval_prompts(num_blanks: int | tuple[int, int] | None = None, count: int | None = None,
                 seed: int | None = None) -> MaskedPrompts:
    """The fixed test puzzles (``evaluate_sudoku``'s set, defaults EVAL_BLANKS / EVAL_PUZZLES / EVAL_SEED) as
    MaskedPrompts: tokens [count, 16], cond {"prompt_mask"}, texts, metadata {"puzzle": [16]}."""
    nb = EVAL_BLANKS if num_blanks is None else num_blanks
    nb = tuple(nb) if isinstance(nb, (list, tuple)) else int(nb)
    puzzles, _ = test_puzzles(nb, EVAL_PUZZLES if count is None else int(count), EVAL_SEED if seed is None else int(seed))
    return _prompts(puzzles)


def solved_fn(filled: torch.Tensor, batch: MaskedPrompts) -> torch.Tensor:
    """The verifier as a pass@k correct_fn: filled digits [N, 16], MaskedPrompts [N] -> [N] bool (grid valid)."""
    return solved(filled, torch.stack([torch.as_tensor(m["puzzle"]) for m in batch.metadata]))


def _prompts(puzzles: torch.Tensor, ids: torch.Tensor | None = None) -> MaskedPrompts:
    tokens, prompt = encode(puzzles)
    return MaskedPrompts(tokens, {"prompt_mask": prompt}, [puzzle_text(p) for p in puzzles],
                         [{"puzzle": p} for p in puzzles], ids)


def masked_world(cfg) -> MaskedWorld:
    """The MaskedWorld of model.kind=sudoku: cfg.rollout.num_blanks for training, cfg.eval.{num_blanks, count,
    seed} for the fixed evaluation and the default pass@k set."""

    def prompts(n: int, seed: int) -> MaskedPrompts:
        puzzles, grids = sample_training_puzzles(n, tuple(cfg.rollout.num_blanks), seed=seed)
        ids = (grids[:, None, :] == solutions()[None]).all(-1).int().argmax(1)  # [n] source grid's row
        return _prompts(puzzles, ids)

    def evaluate(policy) -> dict:
        return evaluate_sudoku(policy, cfg.eval.num_blanks, cfg.eval.count, seed=cfg.eval.seed)[0]

    verifier = Verifier(lambda: eval_prompts(cfg.eval.num_blanks, cfg.eval.count, cfg.eval.seed), solved_fn,
                        "solved (the completed 4x4 grid is valid)")
    return MaskedWorld("sudoku", load_base(cfg.model.path), prompts, decode, "sudoku_cells", evaluate,
                       ("cell_accuracy", "solve_rate"), load_base, external={"solver": solver_sample}, verifier=verifier,
                       parse_prompts=lambda texts: _prompts(torch.stack([parse_puzzle(t) for t in texts])),
                       show=lambda filled: [puzzle_text(g) for g in filled], describe_eval=eval_line)


def eval_line(ev: dict) -> str:
    """The trainer's line of a Sudoku evaluation: the headline, then the test set's size."""
    return format_eval(ev, ("cell_accuracy", "solve_rate"),
                       f"{ev['num_puzzles']} test puzzles, {ev['num_blanks']} blanks" if "num_puzzles" in ev else None)


# the config keys only this world reads (fields in difrl/train/masked/config.py); another masked world refuses them
OWN_KEYS = {"rollout": ("num_blanks",), "eval": ("num_blanks",)}


__all__ = ["BUNDLED_BASE", "CELLS", "EVAL_BLANKS", "MASK_ID", "OWN_KEYS", "PEERS", "VOCAB", "cell_valid",
           "decode", "encode", "eval_prompts", "evaluate_sudoku", "load_base", "make_puzzles", "masked_world",
           "parse_puzzle", "puzzle_text", "sample_training_puzzles", "solution_split", "solutions", "solved", "solved_fn",
           "solver_sample", "sudoku_reward", "test_puzzles"]

"""Train the Sudoku world's deliberately weak base: MDLM on 4x4 puzzles cut from the train solutions.

    python scripts/pretrain_sudoku.py                      # writes difrl/assets/sudoku_base.safetensors
    python scripts/pretrain_sudoku.py --out /tmp/assets    # somewhere else (the reproduction test does this)
    python scripts/pretrain_sudoku.py --eval-every 50      # print the test metrics along the way

LLaDA-SFT-style masked diffusion (spec section 6): the puzzle's givens are the prompt (never
masked), its blanks the answer; each blank is masked with probability t (antithetic t in [eps, 1])
and the loss is the 1/t-weighted masked cross-entropy divided by the number of blanks. Training
runs single-threaded with fixed seeds, so the file is reproducible bit for bit on one machine
(within float tolerance across machines). It stops at a fixed, small step count, far from
convergence, so that the base is weak (about 50% of test cells valid, about 13% of test puzzles
solved): RL has room to show what it does.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from difrl.discrete.losses import forward_mask, mdlm_loss, sample_t
from difrl.discrete.policy import MaskedNetConfig, MaskedTransformer, TinyMaskedPolicy
from difrl.utils.io import save_safetensors
from difrl.utils.rng import mix_seed
from difrl.worlds.sudoku import ASSETS, CELLS, MASK_ID, VOCAB, encode, evaluate_sudoku, sample_training_puzzles

# -------------------------------------------------------------------------------- settings
STEPS = 73  # stop early on purpose: a weak base (~50% of test cells, ~13% solved)
LR = 3e-4
BATCH = 64
TRAIN_BLANKS = (4, 12)  # blanks per training puzzle, drawn uniformly
NET = MaskedNetConfig(vocab_size=VOCAB, mask_id=MASK_ID, seq_len=CELLS, dim=128, layers=3, heads=4, mlp_ratio=4)


def train_base(seed: int = 0, steps: int = STEPS, cfg: MaskedNetConfig = NET, eval_every: int = 0) -> MaskedTransformer:
    torch.manual_seed(seed)
    net = MaskedTransformer(cfg)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.0)
    gen = torch.Generator().manual_seed(mix_seed(seed, 3))
    for step in range(1, steps + 1):
        puzzles, grids = sample_training_puzzles(BATCH, TRAIN_BLANKS, mix_seed(seed, step))
        _, prompt = encode(puzzles)
        target = grids - 1
        t = sample_t(BATCH, gen)
        noisy, masked = forward_mask(target, ~prompt, t, MASK_ID, gen)
        loss = mdlm_loss(TinyMaskedPolicy(net).logits(noisy), target, masked, t, ~prompt)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if eval_every and step % eval_every == 0:
            m, _ = evaluate_sudoku(TinyMaskedPolicy(net))
            print(f"step {step:5d} loss {loss.item():.4f} cell_accuracy {m['cell_accuracy']:.3f} "
                  f"solve_rate {m['solve_rate']:.3f}", flush=True)
    return net.eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ASSETS, help="directory for sudoku_base.safetensors")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--eval-every", type=int, default=0, help="print test metrics every N steps (0: only at the end)")
    args = ap.parse_args()
    torch.set_num_threads(1)  # bit-reproducible

    t0 = time.time()
    net = train_base(args.seed, args.steps, eval_every=args.eval_every)
    elapsed = time.time() - t0
    policy = TinyMaskedPolicy(net)
    metrics, _ = evaluate_sudoku(policy)
    tensors, meta = policy.state_dict_and_meta(steps=args.steps, seed=args.seed, lr=LR, batch=BATCH,
                                               train_blanks=f"{TRAIN_BLANKS[0]}-{TRAIN_BLANKS[1]}",
                                               test_cell_accuracy=f"{metrics['cell_accuracy']:.4f}",
                                               test_solve_rate=f"{metrics['solve_rate']:.4f}")
    args.out.mkdir(parents=True, exist_ok=True)
    save_safetensors(tensors, args.out / "sudoku_base.safetensors", meta)
    print(f"sudoku base ({args.steps} steps, {elapsed:.1f}s): cell_accuracy {metrics['cell_accuracy']:.4f}, "
          f"solve_rate {metrics['solve_rate']:.4f} on {metrics['num_puzzles']} test puzzles "
          f"({metrics['num_blanks']} blanks)")


if __name__ == "__main__":
    main()

"""Train the moving-digits world's deliberately weak base generator (the video flow transformer).

    python scripts/pretrain_moving_digits.py                      # writes difrl/assets/moving_digits_base.safetensors
    python scripts/pretrain_moving_digits.py --out /tmp/assets    # somewhere else (the reproduction test does this)
    python scripts/pretrain_moving_digits.py --eval-every 100     # print the eval metrics along the way

Conditional flow matching on clips rendered from the digits world's train split (difrl/worlds/
moving_digits.py: a random train digit, a random direction and layout per clip, drawn from a
seeded generator): x_sigma = (1 - sigma) x0 + sigma eps, target v = eps - x0, the prompt dropped
(digit and direction both null) with probability 0.1 for classifier-free guidance. The reward's
classifier is the digits world's (difrl/assets/digits_classifier.safetensors, scripts/pretrain_digits.py).
Training runs single-threaded with fixed seeds, so the file is reproducible bit for bit on one machine
(within float tolerance across machines).

The base is weak on purpose, in two ways RL can repair (each leaves groups of samples of one
prompt that differ in the reward):
- identity: training stops at a fixed, small step count (``GENERATOR_STEPS``), far from convergence,
  so about half of the frames show a readable, correct digit;
- direction: half of the training clips are captioned with the opposite direction (a clip moving
  left is captioned "right" with probability ``DIRECTION_CONFUSION``), so the base moves the digit
  along the right axis but picks the sign at random, as real text-to-video models confuse left and
  right. (Uniform caption noise over all 4 directions and 10 digits was tried: this tiny net then
  learned neither motion nor identity in 4,000 steps. Stopping early alone gives a base whose motion
  is not yet coherent (a 0.02-scale position embedding: motion accuracy 0.2 when identity is 0.5),
  and RL then learns a motion that fools the reward's tracker, not the held-out judge.)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from difrl.models.video_flow import NULL_DIGIT, NULL_DIRECTION, MovingDigitsPolicy, VideoFlowNet, VideoNetConfig
from difrl.utils.io import save_safetensors
from difrl.worlds.digits import ASSETS
from difrl.worlds.moving_digits import (MovingDigitsWorld, clips_to_latents, evaluate_moving_digits, load_split,
                                        render_clips, sample_layout)

# -------------------------------------------------------------------------------- settings
GENERATOR_STEPS = 750  # stop early on purpose: about 50% per-frame accuracy
GENERATOR_LR = 1e-3
GENERATOR_BATCH = 64
PROMPT_DROPOUT = 0.1  # so the model also learns the unconditional velocity (CFG)
DIRECTION_CONFUSION = 0.5  # a clip's caption names the opposite direction with this probability


def train_generator(seed: int = 0, steps: int = GENERATOR_STEPS, cfg: VideoNetConfig = VideoNetConfig(),
                    eval_every: int = 0, snapshot=None, direction_confusion: float = DIRECTION_CONFUSION) -> VideoFlowNet:
    """Conditional flow matching on freshly rendered train clips (a new batch every step). Every `eval_every`
    steps: print the eval metrics and call `snapshot(step, net)` (the evaluation draws no training randomness,
    so the net after k steps of a longer run is the net of a k-step run)."""
    split = load_split()
    sprites_all, y_all = split["x_train"], split["y_train"]
    torch.manual_seed(seed)
    net = VideoFlowNet(cfg)
    opt = torch.optim.AdamW(net.parameters(), lr=GENERATOR_LR, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed + 1)
    for step in range(steps):
        idx = torch.randint(0, len(y_all), (GENERATOR_BATCH,), generator=gen)
        directions = torch.randint(0, 4, (GENERATOR_BATCH,), generator=gen)
        perp, jitter = sample_layout(GENERATOR_BATCH, gen, cfg.frames, cfg.size)
        x0 = clips_to_latents(render_clips(sprites_all[idx], directions, perp, jitter, cfg.frames, cfg.size))
        digit, direction = y_all[idx].clone(), directions.clone()
        swap = torch.rand(GENERATOR_BATCH, generator=gen) < direction_confusion
        direction = torch.where(swap, direction ^ 1, direction)  # DIRECTIONS order: left <-> right, up <-> down
        drop = torch.rand(GENERATOR_BATCH, generator=gen) < PROMPT_DROPOUT
        digit[drop], direction[drop] = NULL_DIGIT, NULL_DIRECTION
        eps = torch.randn(x0.shape, generator=gen)
        sigma = torch.rand(GENERATOR_BATCH, generator=gen)
        x = (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * eps
        loss = ((net(x, sigma, digit, direction) - (eps - x0)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if eval_every and (step + 1) % eval_every == 0:
            report(f"step {step + 1} (loss {float(loss.detach()):.3f})", net.eval())
            if snapshot is not None:
                snapshot(step + 1, net)
            net.train()
    return net.eval()


def report(what: str, net: VideoFlowNet, world: MovingDigitsWorld | None = None) -> dict:
    metrics, _ = evaluate_moving_digits(MovingDigitsPolicy(net), world or MovingDigitsWorld.load(), per_prompt=5)
    print(f"{what}: " + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items() if isinstance(v, float)), flush=True)
    return metrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ASSETS, help="directory for moving_digits_base.safetensors")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--generator-steps", type=int, default=GENERATOR_STEPS)
    ap.add_argument("--direction-confusion", type=float, default=DIRECTION_CONFUSION,
                    help="probability that a training clip's caption names the opposite direction")
    ap.add_argument("--eval-every", type=int, default=0, help="print the eval metrics every this many steps (0: only at the end)")
    ap.add_argument("--no-eval", action="store_true", help="skip the final evaluation (the reproduction test)")
    ap.add_argument("--snapshots", action="store_true", help="with --eval-every: also save the base after every "
                    "evaluation as moving_digits_base-step<k>.safetensors (equal to a --generator-steps k run)")
    args = ap.parse_args()
    torch.set_num_threads(1)  # bit-reproducible

    def save(steps: int, net: VideoFlowNet, name: str = "moving_digits_base.safetensors") -> None:
        tensors, meta = MovingDigitsPolicy(net).state_dict_and_meta()
        save_safetensors(tensors, args.out / name, meta | {"steps": str(steps), "seed": str(args.seed),
                                                             "direction_confusion": str(args.direction_confusion)})

    t0 = time.time()
    snapshot = (lambda k, net: save(k, net, f"moving_digits_base-step{k}.safetensors")) if args.snapshots else None
    net = train_generator(args.seed, args.generator_steps, eval_every=args.eval_every, snapshot=snapshot,
                          direction_confusion=args.direction_confusion)
    save(args.generator_steps, net)
    print(f"base generator: {args.generator_steps} steps in {time.time() - t0:.1f}s -> "
          f"{args.out / 'moving_digits_base.safetensors'}")
    if not args.no_eval:
        report("base generator eval", net)


if __name__ == "__main__":
    main()

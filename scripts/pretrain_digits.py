"""Train the digits world's reward classifier and its deliberately weak base generator.

    python scripts/pretrain_digits.py                      # writes difrl/assets/digits_*.safetensors
    python scripts/pretrain_digits.py --out /tmp/assets    # somewhere else (the reproduction test does this)

Both run single-threaded with fixed seeds, so the files are reproducible bit for bit on one
machine (and within float tolerance across machines). The base generator is stopped at a fixed
step count, well before convergence, so that its prompt accuracy is about 60%: RL has room to
show what it does. The classifier trains to about 98% test accuracy.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from difrl.models.digits import NULL_LABEL, DigitsFlowNet, DigitsNetConfig, DigitsPolicy
from difrl.utils.io import save_safetensors
from difrl.worlds.digits import ASSETS, DigitClassifier, DigitsWorld, evaluate_digits, fit_judge, images_to_latents, load_split

# -------------------------------------------------------------------------------- settings
CLASSIFIER_EPOCHS = 40
CLASSIFIER_LR = 2e-3
GENERATOR_STEPS = 120  # stop early on purpose: a weak base (~60% prompt accuracy)
GENERATOR_LR = 1e-3
GENERATOR_BATCH = 128
LABEL_DROPOUT = 0.1  # so the model also learns the unconditional velocity (CFG)


def train_classifier(seed: int = 0, epochs: int = CLASSIFIER_EPOCHS) -> DigitClassifier:
    split = load_split()
    torch.manual_seed(seed)
    clf = DigitClassifier()
    opt = torch.optim.AdamW(clf.parameters(), lr=CLASSIFIER_LR, weight_decay=1e-4)
    gen = torch.Generator().manual_seed(seed)
    x, y = split["x_train"], split["y_train"]
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=gen)
        for lo in range(0, len(x), 64):
            idx = perm[lo:lo + 64]
            xb = x[idx]
            # small random shifts (+-1 px) so the reward is not fooled by exact pixel positions
            dx, dy = torch.randint(-1, 2, (2,), generator=gen).tolist()
            xb = torch.roll(xb, shifts=(dy, dx), dims=(2, 3))
            loss = torch.nn.functional.cross_entropy(clf(xb), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return clf.eval()


def train_generator(seed: int = 0, steps: int = GENERATOR_STEPS, cfg: DigitsNetConfig = DigitsNetConfig()) -> DigitsFlowNet:
    """Conditional flow matching: x_sigma = (1 - sigma) x0 + sigma eps, target v = eps - x0."""
    split = load_split()
    x0_all, y_all = images_to_latents(split["x_train"]), split["y_train"]
    torch.manual_seed(seed)
    net = DigitsFlowNet(cfg)
    opt = torch.optim.AdamW(net.parameters(), lr=GENERATOR_LR, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        idx = torch.randint(0, len(x0_all), (GENERATOR_BATCH,), generator=gen)
        x0, label = x0_all[idx], y_all[idx].clone()
        label[torch.rand(len(idx), generator=gen) < LABEL_DROPOUT] = NULL_LABEL
        eps = torch.randn(x0.shape, generator=gen)
        sigma = torch.rand(len(idx), generator=gen)
        x = (1 - sigma[:, None]) * x0 + sigma[:, None] * eps
        loss = ((net(x, sigma, label) - (eps - x0)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return net.eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ASSETS, help="directory for the two .safetensors files")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--generator-steps", type=int, default=GENERATOR_STEPS)
    args = ap.parse_args()
    torch.set_num_threads(1)  # bit-reproducible

    t0 = time.time()
    clf = train_classifier(args.seed)
    split = load_split()
    with torch.no_grad():
        test_acc = float((clf(split["x_test"]).argmax(-1) == split["y_test"]).float().mean())
    save_safetensors(clf.state_dict(), args.out / "digits_classifier.safetensors",
                     {"test_accuracy": f"{test_acc:.4f}", "epochs": CLASSIFIER_EPOCHS, "seed": args.seed})
    print(f"classifier: test accuracy {test_acc:.4f} ({time.time() - t0:.1f}s)")

    t0 = time.time()
    net = train_generator(args.seed, args.generator_steps)
    meta = {k: str(v) for k, v in vars(net.cfg).items()} | {"steps": args.generator_steps, "seed": args.seed}
    save_safetensors(net.state_dict(), args.out / "digits_base.safetensors", meta)
    world = DigitsWorld(clf, fit_judge())
    metrics, _ = evaluate_digits(DigitsPolicy(net), world)
    print(f"base generator ({args.generator_steps} steps, {time.time() - t0:.1f}s): "
          + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items() if isinstance(v, float)))


if __name__ == "__main__":
    main()

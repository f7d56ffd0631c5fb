"""The digits world: scikit-learn's bundled 8x8 digits, a CNN reward, an unseen SVM judge, eval.

    world = DigitsWorld.load()                       # bundled classifier; judge fitted on the train split
    p = world.classifier_probs(images)               # [B, 10], images [B, 1, 8, 8] in [0, 1]
    metrics, images = evaluate_digits(policy, world, per_digit=50)

Data: ``sklearn.datasets.load_digits`` (1797 images, values 0..16), one fixed stratified split
(80% train / 20% test, ``random_state=0``). Reward: the CNN classifier's p(prompted digit).
Second judge: an RBF SVM on raw pixels, fitted on the train split at load (deterministic, < 1 s),
never seen by training or by stopping rules. Fréchet distance uses the classifier's 64-d
penultimate features (``FEATURE_EXTRACTOR`` names them in every output).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from difrl.eval.metrics import frechet_distance, within_class_diversity
from difrl.models.digits import digit_prompt
from difrl.rewards.digits import BUNDLED_CLASSIFIER, DigitClassifier, load_classifier  # noqa: F401  (the reward model)
from difrl.rollout import rollout
from difrl.utils.collectives import whole
from difrl.utils.images import to_uint8
from difrl.utils.rng import mix_seed
from difrl.worlds import World, check_bundled_config
from difrl.worlds.contract import FDRise, format_eval
from difrl.samplers.schedules import sigma_schedule

ASSETS = Path(__file__).resolve().parent.parent / "assets"
FEATURE_EXTRACTOR = "difrl-digits-cnn-penultimate-64d"
PROMPTS = [digit_prompt(d) for d in range(10)]
HEADLINE = ("accuracy", "fd")  # the eval keys of the progress bar, the CLI table and the plot
# the eval keys of difrl train's before / after table (also the digit-tokens world's): classifier, unseen judge, FD,
# diversity of the samples
BEFORE_AFTER = ("accuracy", "judge_accuracy", "fd", "diversity")


def eval_line(ev: dict) -> str:
    """The trainer's line of a digits evaluation (also the digit-tokens world's): the headline, the unseen judge,
    the diversity of the samples and of the real test images, the FD features, the sample count."""
    return format_eval(ev, HEADLINE + ("judge_accuracy", "diversity", "real_diversity"))


@lru_cache(maxsize=1)
def load_split() -> dict[str, torch.Tensor]:
    """The fixed train/test split as [N, 1, 8, 8] images in [0, 1] and [N] labels."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    as_img = lambda a: torch.tensor(a, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    return {"x_train": as_img(x_tr), "y_train": torch.tensor(y_tr), "x_test": as_img(x_te), "y_test": torch.tensor(y_te)}


def images_to_latents(images: torch.Tensor) -> torch.Tensor:
    """[N, 1, 8, 8] in [0, 1] -> [N, 64] in [-1, 1] (the generator's latent space)."""
    return images.flatten(1) * 2.0 - 1.0


@dataclass
class DigitsWorld:
    classifier: DigitClassifier
    judge: object  # sklearn SVC on pixels, fitted on the train split
    _real: tuple | None = None  # cached test-set features and diversity

    @classmethod
    def load(cls, classifier_path: str | Path | None = None) -> "DigitsWorld":
        return cls(load_classifier(classifier_path), fit_judge())

    @torch.no_grad()
    def classifier_probs(self, images: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.classifier(images.float()), dim=-1)

    @torch.no_grad()
    def features(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier.features(images.float())

    def judge_predict(self, images: torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(self.judge.predict(images.flatten(1).double().numpy()))


@lru_cache(maxsize=1)
def fit_judge():
    from sklearn.svm import SVC

    split = load_split()
    return SVC(gamma="scale", C=10.0).fit(split["x_train"].flatten(1).double().numpy(), split["y_train"].numpy())


def real_reference(world: DigitsWorld) -> tuple[torch.Tensor, float]:
    """Test-set features and within-class diversity (cached on the world)."""
    if world._real is None:
        split = load_split()
        world._real = (world.features(split["x_test"]), within_class_diversity(split["x_test"], split["y_test"]))
    return world._real


@torch.no_grad()
def sample_eval_images(policy, per_digit: int = 50, num_steps: int = 10, seed: int = 1234, shift: float = 1.0,
                       guidance: float = 1.0, batch_size: int = 500, split=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed-seed ODE samples: per_digit images of each digit. Returns images [10*per_digit, 1, 8, 8], labels.
    `split` (n -> (rows, finish), difrl.utils.collectives.split_rows): this process samples its rows, finish gathers."""
    labels = torch.arange(10).repeat_interleave(per_digit)
    seeds = torch.tensor([mix_seed(seed, i) for i in range(len(labels))])
    rows, finish = (split or whole)(len(labels))
    batch = rollout(policy, [PROMPTS[int(d)] for d in labels[rows]], seeds[rows], sigma_schedule(num_steps, shift),
                    kernel="ode", sde_mask=torch.zeros(num_steps, dtype=torch.bool), guidance=guidance,
                    batch_size=batch_size)
    return finish(policy.decode(batch.x_final)), labels


def evaluate_digits(policy, world: DigitsWorld, per_digit: int = 50, num_steps: int = 10, seed: int = 1234,
                    shift: float = 1.0, split=None) -> tuple[dict, torch.Tensor]:
    """The digits eval (no CFG, ODE, fixed seeds); `split`: sample_eval_images'. Returns (metrics, images)."""
    images, labels = sample_eval_images(policy, per_digit, num_steps, seed, shift, split=split)
    return image_metrics(world, images, labels, num_steps), images


def image_metrics(world: DigitsWorld, images: torch.Tensor, labels: torch.Tensor, num_steps: int) -> dict:
    """The digits world's image metrics of generated `images` [N, 1, 8, 8] in [0, 1] prompted with
    `labels` [N] (any generator: the flow digits eval and the digit-tokens eval share this):
    accuracy (classifier argmax == label), judge_accuracy (the unseen SVM), reward (mean classifier
    p(label)), fd (Fréchet distance to the test split on ``FEATURE_EXTRACTOR`` features), diversity
    (within-class, vs the test split's real_diversity), samples and num_steps (recorded as given)."""
    real_feats, real_div = real_reference(world)
    probs = world.classifier_probs(images)
    return {
        "accuracy": float((probs.argmax(-1) == labels).float().mean()),
        "judge_accuracy": float((world.judge_predict(images) == labels).float().mean()),
        "reward": float(probs[torch.arange(len(labels)), labels].mean()),
        "fd": frechet_distance(world.features(images), real_feats),
        "fd_extractor": FEATURE_EXTRACTOR,
        "diversity": within_class_diversity(images, labels),
        "real_diversity": real_div,
        "samples": int(len(labels)),
        "num_steps": num_steps,
    }


def image_grid(images: torch.Tensor, nrow: int, scale: int = 4, pad: int = 1) -> np.ndarray:
    """[N, 1|3, H, W] in [0, 1] -> uint8 HxWx3 grid, each image upscaled `scale`x (nearest) for viewing."""
    n, c, h, w = images.shape
    imgs = images.clamp(0, 1).repeat_interleave(scale, 2).repeat_interleave(scale, 3)
    if c == 1:
        imgs = imgs.expand(-1, 3, -1, -1)
    rows = (n + nrow - 1) // nrow
    H, W = h * scale + pad, w * scale + pad
    grid = torch.ones(3, rows * H + pad, nrow * W + pad) * 0.5
    for i in range(n):
        r, col = divmod(i, nrow)
        grid[:, pad + r * H: pad + r * H + h * scale, pad + col * W: pad + col * W + w * scale] = imgs[i]
    return to_uint8(grid).permute(1, 2, 0).numpy()


# ---- the world the flow trainer runs (difrl.worlds.WORLDS["digits"]) ----

def flow_world(kind: str, model_path: str | None, cfg=None) -> World:
    """The digits world (the bundled 8x8 flow model and its classifier reward); `cfg` is not read."""
    from PIL import Image

    from difrl.models.digits import DigitsPolicy

    world = DigitsWorld.load()
    policy = DigitsPolicy.from_checkpoint(model_path)

    def evaluate(policy, per_digit=50, num_steps=10, seed=1234, shift=1.0, split=None):
        return evaluate_digits(policy, world, per_digit, num_steps, seed, shift, split)

    def save_grid(images: torch.Tensor, path: Path) -> None:
        # images come prompt-major (per_digit of 0, then of 1, ...): one row per digit, 10 samples each
        per = images.shape[0] // 10
        rows = torch.cat([images[d * per: d * per + min(per, 10)] for d in range(10)])
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image_grid(rows, nrow=min(per, 10))).save(path)

    return World("digits", policy, list(PROMPTS), evaluate, save_grid, lambda pid: {"digit": pid}, device="cpu",
                 default_reward="digit_prob", headline=HEADLINE, stop=FDRise(), describe_eval=eval_line,
                 before_after=BEFORE_AFTER)


check_config = check_bundled_config  # gradient checkpointing, compile, the eval panel: refused

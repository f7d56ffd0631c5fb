"""The moving-digits world (video): a bundled 8x8 digit crossing a 16x16 canvas in a prompted direction.

    world = MovingDigitsWorld.load()                       # bundled classifier; judge fitted on the train split
    clips = render_clips(sprites, directions, perp, jitter)  # [N, F, 1, 16, 16] in [0, 1]
    metrics, videos = evaluate_moving_digits(policy, world, per_prompt=10)   # videos [N, F, 3, 16, 16]
    save_gif(videos, "samples/after.gif", per_prompt=10)

Clips: F = 8 frames; the digit (scikit-learn's bundled 8x8 digits, the digits world's fixed split)
moves 1 pixel per frame in one of four directions, 7 pixels in all, starting at the canvas edge it
leaves (``JITTER`` = 0 extra pixels), at the middle across the motion (``PERP`` = 4). The layout is
fixed per direction, so a clip's randomness is the digit's handwriting: with random offsets (1..7)
and starts, an earlier base of this size still had 0.5% motion accuracy after 800 steps. Prompts:
"a {digit} moving {left|right|up|down}", 40 of them, prompt id = 4 * digit + direction.

Evaluation (no CFG, ODE, fixed seeds, `per_prompt` clips of every prompt): `accuracy` is the per-frame
identity accuracy (the reward's classifier on each frame's located digit crop), `motion_accuracy` the
fraction of clips whose located digit window moves in the prompted direction at >= half the world's
speed (the reward's tracker, difrl/rewards/moving_digits.py), `reward` the mean of the default
`moving_digit` reward. The held-out judge never seen by training: an RBF SVM on raw pixels (the digits world's judge) on a crop centred
on each frame's centre of mass (`judge_accuracy`, per frame), and a motion estimate by integer
block matching between consecutive frames (`judge_motion_accuracy`): other localisation, other
classifier, other motion estimator. `fd` is the Fréchet distance to clips rendered from the test
split on ``FEATURE_EXTRACTOR`` features: per clip, the mean and the mean absolute change of the
classifier's 64-d crop features over frames (difrl.eval.panel.clip_features), and the centre of
mass velocity (px / frame, x ``VELOCITY_SCALE`` so that motion weighs in the distance: unscaled, its
variance is 1/700 of the appearance features' and still clips would score like moving ones).
`diversity` is the within-prompt mean pairwise L2 distance between clips (pixels), against the test
clips' `real_diversity`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from difrl.eval.metrics import frechet_distance, within_class_diversity
from difrl.eval.panel import clip_features
from difrl.models.video_flow import DIRECTIONS, moving_digit_prompt
from difrl.rewards.digits import BUNDLED_CLASSIFIER, DigitClassifier, load_classifier
from difrl.rewards.moving_digits import (SPEED, SPRITE, UNIT, centre_of_mass, clip_terms, crop_at, digit_track, grey,
                                         locate_crops, motion_direction_of, velocity)
from difrl.rollout import rollout
from difrl.samplers.schedules import sigma_schedule
from difrl.utils.collectives import whole
from difrl.utils.rng import mix_seed
from difrl.worlds import World, check_bundled_config
from difrl.worlds.contract import FDRise, format_eval
from difrl.worlds.digits import fit_judge, image_grid, load_split

FRAMES, SIZE = 8, 16
FEATURE_EXTRACTOR = "difrl-moving-digits-crop-cnn-64d-mean+motion+com-velocity"
PROMPTS = [moving_digit_prompt(d, k) for d in range(10) for k in DIRECTIONS]  # prompt id = 4 * digit + direction
REFERENCE_SEED = 0  # the test clips' layouts
VELOCITY_SCALE = 10.0  # FD features: the velocity's variance (0.5 per axis) x 100 = 1/7 of the crop features' (720)
PERP = (4, 4)  # the top-left corner across the motion: a pixel range (inclusive)
JITTER = 0  # the start along the motion: 0..JITTER pixels from the edge the digit leaves


def prompt_id(digit: int, direction: int) -> int:
    return 4 * digit + direction


# ---------------------------------------------------------------------------------- clips


def sample_layout(n: int, generator: torch.Generator, frames: int = FRAMES, size: int = SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """(perpendicular offset [n] in PERP, start jitter [n] in 0..JITTER) for n clips."""
    if (frames - 1) * SPEED + JITTER > size - SPRITE or PERP[1] > size - SPRITE:
        raise ValueError(f"{frames} frames at {SPEED:g} px/frame do not fit an {SPRITE}-pixel digit on a {size}-pixel canvas")
    perp = torch.randint(PERP[0], PERP[1] + 1, (n,), generator=generator)
    jitter = torch.randint(0, JITTER + 1, (n,), generator=generator)
    return perp, jitter


def render_clips(sprites: torch.Tensor, directions: torch.Tensor, perp: torch.Tensor, jitter: torch.Tensor,
                 frames: int = FRAMES, size: int = SIZE) -> torch.Tensor:
    """Sprites [N, 1, 8, 8] in [0, 1] moving 1 px per frame in `directions` [N] (index into DIRECTIONS) ->
    clips [N, F, 1, size, size]. The top-left corner along the motion starts `jitter` from the edge the digit
    leaves (left: x0 = size - 8 - jitter, then x0 - t); across the motion it sits at `perp`."""
    N = sprites.shape[0]
    span = size - SPRITE
    clips = torch.zeros(N, frames, 1, size, size)
    for i in range(N):
        u = UNIT[int(directions[i])]
        for t in range(frames):
            # positive direction: start at jitter and move +t; negative: start at span - jitter and move -t
            along = int(jitter[i]) + t if float(u.sum()) > 0 else span - int(jitter[i]) - t
            x, y = (along, int(perp[i])) if float(u[0]) != 0 else (int(perp[i]), along)
            clips[i, t, :, y:y + SPRITE, x:x + SPRITE] = sprites[i]
    return clips


def clips_to_latents(clips: torch.Tensor) -> torch.Tensor:
    """[N, F, 1, H, W] in [0, 1] -> [N, F, H*W] in [-1, 1] (the generator's latent space)."""
    return clips.flatten(2) * 2.0 - 1.0


@lru_cache(maxsize=1)
def reference_clips() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The test split's clips, every test digit in each of the 4 directions, fixed layouts: (clips
    [4 N, F, 3, H, W] in [0, 1], digits [4 N], directions [4 N])."""
    split = load_split()
    x, y = split["x_test"], split["y_test"]
    n = len(y)
    directions = torch.arange(4).repeat(n)
    sprites, digits = x.repeat_interleave(4, 0), y.repeat_interleave(4)
    perp, jitter = sample_layout(4 * n, torch.Generator().manual_seed(REFERENCE_SEED))
    clips = render_clips(sprites, directions, perp, jitter)
    return clips.expand(-1, -1, 3, -1, -1).contiguous(), digits, directions


# ---------------------------------------------------------------------------------- the world


@dataclass
class MovingDigitsWorld:
    classifier: DigitClassifier
    judge: object  # sklearn SVC on 8x8 pixels, fitted on the digits train split
    classifier_path: Path = BUNDLED_CLASSIFIER
    _real: tuple | None = None  # cached test-clip features and diversity

    @classmethod
    def load(cls, classifier_path: str | Path | None = None) -> "MovingDigitsWorld":
        path = Path(classifier_path).resolve() if classifier_path else BUNDLED_CLASSIFIER
        return cls(load_classifier(path), fit_judge(), path)

    @torch.no_grad()
    def frame_probs(self, videos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(classifier probabilities [B, F, 10] of each frame's located crop, the crops [B, F, 1, 8, 8], their
        top-left corners [B, F, 2]: the reward's digit track)."""
        return digit_track(self.classifier, grey(videos))

    @torch.no_grad()
    def features(self, videos: torch.Tensor) -> torch.Tensor:
        """``FEATURE_EXTRACTOR``: [B, F, 3, H, W] -> [B, 2 * 64 + 2]."""
        crops, _ = locate_crops(grey(videos))
        B, F = crops.shape[:2]
        per_frame = self.classifier.features(crops.flatten(0, 1)).view(B, F, -1)
        return torch.cat([clip_features(per_frame), VELOCITY_SCALE * velocity(centre_of_mass(grey(videos)))], 1)

    def judge_frames(self, videos: torch.Tensor) -> torch.Tensor:
        """The unseen judge's digit [B, F]: the SVM on an 8x8 crop centred on each frame's centre of mass."""
        frames = grey(videos)
        B, F, H, W = frames.shape
        corner = (centre_of_mass(frames) - (SPRITE - 1) / 2).round().long()
        x0, y0 = corner[..., 0].clamp(0, W - SPRITE), corner[..., 1].clamp(0, H - SPRITE)
        crops = crop_at(frames, x0, y0)
        return torch.as_tensor(self.judge.predict(crops.reshape(B * F, -1).double().numpy())).view(B, F)


def block_motion(videos: torch.Tensor, radius: int = 2) -> torch.Tensor:
    """The judge's motion estimate: the sum over consecutive frame pairs of the integer shift (dx, dy), |d| <=
    radius, that best maps frame t onto frame t + 1 (least mean absolute difference over the overlap). [B, 2]."""
    frames = grey(videos)
    a, b = frames[:, :-1], frames[:, 1:]  # [B, F-1, H, W]
    H, W = frames.shape[-2:]
    shifts, errors = [], []
    for dy in range(-radius, radius + 1):
        for dx in range(-radius, radius + 1):
            moved = torch.roll(a, (dy, dx), (2, 3))
            ys = slice(max(dy, 0), H + min(dy, 0))
            xs = slice(max(dx, 0), W + min(dx, 0))
            errors.append((moved[..., ys, xs] - b[..., ys, xs]).abs().mean((-1, -2)))  # [B, F-1]
            shifts.append((dx, dy))
    best = torch.stack(errors, -1).argmin(-1)  # [B, F-1]
    return torch.tensor(shifts, dtype=torch.float32)[best].sum(1)


_REAL: dict[str, tuple[torch.Tensor, float]] = {}  # classifier file -> test-clip features and diversity


def real_reference(world: MovingDigitsWorld) -> tuple[torch.Tensor, float]:
    """Test-clip features and within-prompt diversity (cached on the world, and per classifier file for the
    process: every world of a run, test or benchmark with the same classifier shares them)."""
    if world._real is None:
        key = str(world.classifier_path)
        if key not in _REAL:
            clips, digits, directions = reference_clips()
            _REAL[key] = (world.features(clips), within_class_diversity(clips[:, :, :1], prompt_id(digits, directions)))
        world._real = _REAL[key]
    return world._real


@torch.no_grad()
def sample_eval_videos(policy, per_prompt: int = 10, num_steps: int = 10, seed: int = 1234, shift: float = 1.0,
                       guidance: float = 1.0, batch_size: int = 400, split=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed-seed ODE clips, per_prompt of each of the 40 prompts (prompt-major). Returns videos [40 per_prompt,
    F, 3, H, W] and their prompt ids. `split` (n -> (rows, finish), difrl.utils.collectives.split_rows): this process
    samples its rows and finish gathers every process's."""
    ids = torch.arange(len(PROMPTS)).repeat_interleave(per_prompt)
    seeds = torch.tensor([mix_seed(seed, i) for i in range(len(ids))])
    rows, finish = (split or whole)(len(ids))
    batch = rollout(policy, [PROMPTS[int(i)] for i in ids[rows]], seeds[rows], sigma_schedule(num_steps, shift),
                    kernel="ode", sde_mask=torch.zeros(num_steps, dtype=torch.bool), guidance=guidance,
                    batch_size=batch_size)
    return finish(policy.decode(batch.x_final)), ids


def evaluate_moving_digits(policy, world: MovingDigitsWorld, per_prompt: int = 10, num_steps: int = 10,
                           seed: int = 1234, shift: float = 1.0, split=None) -> tuple[dict, torch.Tensor]:
    """The moving-digits eval (no CFG, ODE, fixed seeds); `split`: sample_eval_videos'. Returns (metrics, videos)."""
    videos, ids = sample_eval_videos(policy, per_prompt, num_steps, seed, shift, split=split)
    return video_metrics(world, videos, ids, num_steps), videos


def video_metrics(world: MovingDigitsWorld, videos: torch.Tensor, ids: torch.Tensor, num_steps: int) -> dict:
    """Metrics of clips `videos` [N, F, 3, H, W] in [0, 1] prompted with prompt ids `ids` [N] (see the module
    docstring); `reward` is the default moving_digit reward's mean (identity + motion + 0.5 consistency)."""
    digits, directions = ids // 4, ids % 4
    real_feats, real_div = real_reference(world)
    t = clip_terms(*world.frame_probs(videos), digits, directions)  # the rewards' terms, per clip [N]
    judged = world.judge_frames(videos)
    judge_dir = motion_direction_of(block_motion(videos) / (videos.shape[1] - 1))
    return {
        "accuracy": float(t["correct"].mean()),  # every clip has F frames: the mean over all frames
        "motion_accuracy": float(t["moving"].mean()),
        "judge_accuracy": float((judged == digits[:, None]).float().mean()),
        "judge_motion_accuracy": float((judge_dir == directions).float().mean()),
        "reward": float((t["identity"] + t["motion"] + 0.5 * t["consistency"]).mean()),
        "identity": float(t["identity"].mean()), "motion": float(t["motion"].mean()),
        "consistency": float(t["consistency"].mean()),
        "fd": frechet_distance(world.features(videos), real_feats),
        "fd_extractor": FEATURE_EXTRACTOR,
        "diversity": within_class_diversity(videos[:, :, :1], ids),
        "real_diversity": real_div,
        "samples": int(len(ids)),
        "num_steps": num_steps,
    }


# ---------------------------------------------------------------------------------- GIFs


def gif_frames(videos: torch.Tensor, nrow: int, scale: int = 3) -> list[np.ndarray]:
    """[N, F, C, H, W] in [0, 1] -> F grey uint8 grids (H', W'), clip i at row i // nrow, column i % nrow."""
    return [image_grid(videos[:, f], nrow=nrow, scale=scale)[..., 0] for f in range(videos.shape[1])]


def save_gif(videos: torch.Tensor, path: str | Path, nrow: int, scale: int = 3, frame_ms: int = 150) -> Path:
    """An animated, looping GIF of clip grids, frames in order, 8-bit grey (mode L: the values are stored as
    they are, no palette dithering). Pillow merges consecutive frames that are identical (all clips still)
    into one longer frame. Returns the path written."""
    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    frames = [Image.fromarray(f) for f in gif_frames(videos, nrow, scale)]  # 2-D uint8: mode L
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=frame_ms, loop=0)
    return path


def grid_order(per_prompt: int, per_cell: int = 3) -> torch.Tensor:
    """Indices into prompt-major eval clips for a 10-row grid: row = digit, columns = 4 directions x per_cell."""
    k = min(per_cell, per_prompt)
    return torch.tensor([prompt_id(d, r) * per_prompt + j for d in range(10) for r in range(4) for j in range(k)])


# ---- the world the flow trainer runs (difrl.worlds.WORLDS["moving_digits"]) ----

def flow_world(kind: str, model_path: str | None, cfg=None) -> World:
    """The moving-digits world; `cfg.model.prompts` (if set) are the training prompts (checked by check_config)."""
    from difrl.models.video_flow import MovingDigitsPolicy, parse_moving_prompt

    world = MovingDigitsWorld.load()
    policy = MovingDigitsPolicy.from_checkpoint(model_path)
    prompts = list(PROMPTS)  # model.prompts (if set): train on those; the eval always covers all 40
    if cfg is not None and getattr(cfg.model, "prompts", None):
        prompts = [str(p) for p in cfg.model.prompts]
        for p in prompts:
            parse_moving_prompt(p)  # an unreadable prompt stops the run here, named (check_config names the key)

    def evaluate(policy, per_digit=10, num_steps=10, seed=1234, shift=1.0, split=None):
        return evaluate_moving_digits(policy, world, per_digit, num_steps, seed, shift, split)

    def save_grid(videos: torch.Tensor, path: Path) -> None:
        # a GIF beside the trainer's .png name: row = digit, columns = left, right, up, down x 3 samples
        per = videos.shape[0] // len(PROMPTS)
        save_gif(videos[grid_order(per)], Path(path).with_suffix(".gif"), nrow=4 * min(per, 3))

    def metadata(pid: int) -> dict:
        digit, direction = parse_moving_prompt(prompts[pid])
        return {"digit": digit, "direction": direction, "prompt_id": pid}

    headline = ("accuracy", "motion_accuracy", "fd")
    return World("moving_digits", policy, prompts, evaluate, save_grid, metadata, device="cpu",
                 default_reward="moving_digit", headline=headline, stop=FDRise(),
                 describe_eval=lambda ev: format_eval(ev, headline + ("judge_accuracy", "judge_motion_accuracy",
                                                                      "diversity", "real_diversity")),
                 before_after=("accuracy", "judge_accuracy", "motion_accuracy", "judge_motion_accuracy", "fd",
                               "diversity"))


def check_config(cfg) -> None:
    """What this world refuses of a FlowConfig: the diffusers-only keys, and model.prompts it cannot read."""
    from difrl.config import config_error
    from difrl.models.video_flow import parse_moving_prompt

    check_bundled_config(cfg)
    for i, p in enumerate(cfg.model.prompts or ()):
        try:
            parse_moving_prompt(str(p))
        except ValueError as e:
            raise config_error(f"model.prompts[{i}]", str(e)) from None

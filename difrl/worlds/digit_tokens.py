"""The digit-tokens world: the 8x8 digits as 64 tokens over 17 grey levels, a label-conditioned
masked-diffusion generator, and the digits world's classifier as reward and metrics.

    world = DigitsWorld.load()                            # the flow digits world's classifier, judge, FD features
    labels = sample_training_labels(64, seed=3)           # [64] digits 0..9 (the prompts)
    tokens, cond = start_tokens(labels)                   # [64, 64] all MASK_ID; cond {"label", "prompt_mask"}
    out = emerge_sample(policy, tokens, cond, seeds=...)  # any difrl.discrete sampler
    r = digit_token_reward(out.tokens, labels, world)     # [64] classifier p(label | image)
    metrics, images = evaluate_digit_tokens(load_base(), world)   # the digits world's keys + nfe, sampler
    masked = masked_world(cfg)                            # the MaskedWorld of model.kind=digit_tokens

Tokens: pixel k of the row-major 8x8 image is token k; its value v in 0..16 (sklearn's grey levels)
is token id v, ``MASK_ID = 17``. The prompt is the digit label, passed as ``cond["label"]`` (the
network adds a label embedding to every position); no token position is prompt, so a rollout
starts fully masked. Reward and every metric are the flow digits world's (``digits.image_metrics``),
applied to ``tokens_to_images``: accuracy = classifier argmax == prompted digit, Fréchet distance on
the classifier's penultimate features against the test split, judge accuracy from the unseen SVM.

The bundled base (``scripts/pretrain_digit_tokens.py``) is an early-stopped label-conditioned MDLM
(500 steps): noisy digits, about half of them the prompted one (eval accuracy 0.56, FD 134.8), so
RL has room to raise accuracy (``configs/digit_tokens.yaml``: 0.56 -> 0.95 with FD 134.8 -> 43.7 in
60 iterations).
"""

from __future__ import annotations

from pathlib import Path

import torch

from difrl.models.digits import digit_prompt
from difrl.utils.rng import mix_seed
from difrl.worlds.digits import BEFORE_AFTER, HEADLINE, DigitsWorld, eval_line, image_grid, image_metrics
from difrl.worlds.masked import MaskedPrompts, MaskedWorld

ASSETS = Path(__file__).resolve().parent.parent / "assets"
BUNDLED_BASE = ASSETS / "digit_tokens_base.safetensors"
LEVELS = 17  # grey levels 0..16 -> token ids 0..16
MASK_ID = 17
VOCAB = 18
SEQ_LEN = 64  # 8 x 8, row-major
NUM_LABELS = 10
EVAL_PER_DIGIT, EVAL_SEED = 50, 1234
# The eval's default settings per sampler (any keyword given to evaluate_digit_tokens overrides them).
# emerge = MDLM ancestral / MaskGRPO emerge: positions unmask at random on a cosine schedule, tokens
# drawn at T = 1 (the model's own distribution; what the RL rollouts use).
DEFAULT_SAMPLER = "emerge"
SAMPLER_DEFAULTS = {
    "emerge": dict(steps=16, schedule="cosine", temperature=1.0),
    "llada": dict(steps=16, temperature=1.0),
    "eb": dict(gamma=1.0, temperature=1.0),
}
_WHAT = "digit-tokens masked transformer checkpoint"


def images_to_tokens(images: torch.Tensor) -> torch.Tensor:
    """[N, 1, 8, 8] in [0, 1] -> [N, 64] long token ids round(16 x) in 0..16 (exact on sklearn's levels)."""
    if images.ndim != 4 or tuple(images.shape[1:]) != (1, 8, 8):
        raise ValueError(f"images must be [N, 1, 8, 8], got {tuple(images.shape)}")
    return (images.float().clamp(0, 1) * (LEVELS - 1)).round().long().flatten(1)


def tokens_to_images(tokens: torch.Tensor) -> torch.Tensor:
    """[N, 64] token ids -> [N, 1, 8, 8] fp32 in [0, 1] (id / 16; a still-masked token shows as 0)."""
    if tokens.ndim != 2 or tokens.shape[1] != SEQ_LEN:
        raise ValueError(f"tokens must be [N, {SEQ_LEN}], got {tuple(tokens.shape)}")
    levels = torch.where(tokens == MASK_ID, torch.zeros_like(tokens), tokens).clamp(0, LEVELS - 1)
    return (levels.float() / (LEVELS - 1)).view(-1, 1, 8, 8)


def start_tokens(labels: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A rollout's start for prompts `labels` [N] long: (tokens [N, 64] all MASK_ID,
    cond {"label": labels, "prompt_mask": [N, 64] all False}). The label is the whole prompt."""
    labels = torch.as_tensor(labels, dtype=torch.long).reshape(-1)
    n = labels.shape[0]
    return (torch.full((n, SEQ_LEN), MASK_ID, dtype=torch.long),
            {"label": labels, "prompt_mask": torch.zeros(n, SEQ_LEN, dtype=torch.bool)})


def sample_training_labels(n: int, seed: int) -> torch.Tensor:
    """[n] long digits drawn uniformly from 0..9, a pure function of (n, seed)."""
    gen = torch.Generator().manual_seed(mix_seed(seed, 5))
    return torch.randint(0, NUM_LABELS, (n,), generator=gen)


def digit_token_reward(tokens: torch.Tensor, labels: torch.Tensor, world: DigitsWorld) -> torch.Tensor:
    """[N] fp32: the digits classifier's p(labels[i] | tokens_to_images(tokens[i]))."""
    labels = torch.as_tensor(labels, dtype=torch.long).reshape(-1)
    probs = world.classifier_probs(tokens_to_images(tokens))
    return probs[torch.arange(len(labels)), labels].float()


def load_base(path: str | Path | None = None):
    """The bundled weak base (or a checkpoint at `path`) as a TinyMaskedPolicy; a file that is missing,
    unreadable or not a digit-tokens model (10 labels, vocabulary 18, 64 positions) raises, naming it."""
    from difrl.discrete.policy import TinyMaskedPolicy

    return TinyMaskedPolicy.from_checkpoint(Path(path) if path else BUNDLED_BASE, what=_WHAT, expect=dict(
        num_labels=NUM_LABELS, vocab_size=VOCAB, mask_id=MASK_ID, seq_len=SEQ_LEN))


@torch.no_grad()
def sample_digit_tokens(policy, labels: torch.Tensor, seeds: torch.Tensor, sampler: str = DEFAULT_SAMPLER,
                        batch: int = 500, **sampler_kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Generate one image per label with per-sample `seeds` [N] (a sample depends on its seed only, not
    on the batching). Returns (tokens [N, 64], forward passes per sample [N] long). The caller sets
    the net's mode."""
    from difrl.discrete.samplers import SAMPLERS

    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}; known: {', '.join(SAMPLERS)}")
    kw = dict(SAMPLER_DEFAULTS.get(sampler, {})) | sampler_kw
    tokens, nfe = [], []
    for lo in range(0, len(labels), batch):
        start, cond = start_tokens(labels[lo:lo + batch])
        out = SAMPLERS[sampler](policy, start, cond, seeds=seeds[lo:lo + batch], **kw)
        tokens.append(out.tokens)
        nfe.append(out.nfe_per_sample)
    return torch.cat(tokens), torch.cat(nfe)


def evaluate_digit_tokens(policy, world: DigitsWorld, per_digit: int = EVAL_PER_DIGIT, sampler: str = DEFAULT_SAMPLER,
                          seed: int = EVAL_SEED, batch: int = 500, **sampler_kw) -> tuple[dict, torch.Tensor]:
    """The digit-tokens eval: per_digit samples of each digit (labels arange(10).repeat_interleave(per_digit),
    prompt-major like the flow digits eval), sample i seeded mix_seed(seed, i), sampler settings
    ``SAMPLER_DEFAULTS[sampler]`` updated by `sampler_kw`. Returns (metrics, images [10 per_digit, 1, 8, 8]):
    the keys of ``digits.image_metrics`` (num_steps = the sampler's ``steps``, 0 for one without a fixed
    count such as eb) plus "nfe" (mean forward passes per sample) and "sampler"."""
    labels = torch.arange(NUM_LABELS).repeat_interleave(per_digit)
    seeds = torch.tensor([mix_seed(seed, i) for i in range(len(labels))], dtype=torch.int64)
    kw = dict(SAMPLER_DEFAULTS.get(sampler, {})) | sampler_kw
    net = policy.module
    was_training = net.training
    net.eval()
    try:
        tokens, nfe = sample_digit_tokens(policy, labels, seeds, sampler, batch, **kw)
    finally:
        net.train(was_training)
    images = tokens_to_images(tokens)
    metrics = image_metrics(world, images, labels, int(kw.get("steps", 0)))
    metrics |= {"nfe": float(nfe.float().mean()), "sampler": sampler}
    return metrics, images


def save_grid(images: torch.Tensor, path: str | Path) -> None:
    """A PNG of prompt-major `images` (as evaluate_digit_tokens returns them): one row per digit, up to
    10 samples each."""
    from PIL import Image

    per = images.shape[0] // NUM_LABELS
    if per < 1:
        raise ValueError(f"need at least one image per digit (prompt-major), got {images.shape[0]} images")
    rows = torch.cat([images[d * per: d * per + min(per, 10)] for d in range(NUM_LABELS)])
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image_grid(rows, nrow=min(per, 10))).save(path)


def masked_world(cfg) -> MaskedWorld:
    """The MaskedWorld of model.kind=digit_tokens: cfg.eval.{per_digit, seed} for the evaluation."""
    images_world = DigitsWorld.load()

    def prompts(n: int, seed: int) -> MaskedPrompts:
        labels = sample_training_labels(n, seed)
        tokens, cond = start_tokens(labels)
        return MaskedPrompts(tokens, cond, [digit_prompt(d) for d in labels.tolist()],
                             [{"digit": d} for d in labels.tolist()], labels)

    def evaluate(policy) -> dict:
        return evaluate_digit_tokens(policy, images_world, cfg.eval.per_digit, seed=cfg.eval.seed)[0]

    def save_samples(policy, path: Path) -> None:
        _, images = evaluate_digit_tokens(policy, images_world, min(cfg.eval.per_digit, 10), seed=cfg.eval.seed)
        save_grid(images, path)

    def parse_prompts(texts: list[str]) -> MaskedPrompts:
        from difrl.models.digits import NULL_LABEL, parse_digit_prompt

        labels = torch.tensor([parse_digit_prompt(t) for t in texts])
        if bool((labels == NULL_LABEL).any()):
            raise ValueError("the digit-tokens model has no unconditional prompt: write e.g. 'a handwritten 3'")
        tokens, cond = start_tokens(labels)
        return MaskedPrompts(tokens, cond, list(texts), [{"digit": d} for d in labels.tolist()], labels)

    return MaskedWorld("digit_tokens", load_base(cfg.model.path), prompts, tokens_to_images, "digit_prob",
                       evaluate, HEADLINE, load_base, save_samples, parse_prompts=parse_prompts,
                       describe_eval=eval_line, before_after=BEFORE_AFTER)


__all__ = ["BUNDLED_BASE", "DEFAULT_SAMPLER", "EVAL_PER_DIGIT", "EVAL_SEED", "LEVELS", "MASK_ID",
           "NUM_LABELS", "SAMPLER_DEFAULTS", "SEQ_LEN", "VOCAB", "digit_token_reward",
           "evaluate_digit_tokens", "images_to_tokens", "load_base", "masked_world", "sample_digit_tokens",
           "sample_training_labels", "save_grid", "start_tokens", "tokens_to_images"]

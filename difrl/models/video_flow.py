"""The moving-digits world's generator: a tiny prompt-conditioned video flow transformer over frame tokens.

    policy = MovingDigitsPolicy.from_checkpoint()                 # the bundled weak base model
    cond = policy.encode(["a 3 moving left", "the digit seven moving up"])
    v = policy.velocity(x, sigma, cond)                           # x: [B, F, H*W] in the [-1, 1] pixel scale
    videos = policy.decode(x)                                     # [B, F, 3, H, W] in [0, 1]

A tiny video DiT (VideoFlowNet): patch tokens with a learned (frame, patch) position embedding,
adaLN-Zero blocks of self-attention and an MLP; the bundled base uses one 16 x 16 patch per frame,
so the attention is what lets the 8 frames agree on one digit and one direction, and a forward costs
about 6 M multiply-adds per clip (RL in minutes on 2 CPU cores). The conditioning is
sinusoidal(1000 sigma) + a digit embedding + a direction embedding (factorised, so "a 7 moving up"
shares what "7" and "up" mean with the other prompts). Digit 10 / direction 4 are the "no prompt"
tokens of classifier-free guidance (trained with prompt dropout).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from difrl.models.base import Cond, HoldsNet
from difrl.models.digits import DIGIT_WORDS, gated_mlp, net_from_checkpoint, sigma_embedding, zero_linear

DIRECTIONS = ("left", "right", "up", "down")
# unit displacement per frame (dx, dy) in image coordinates (y grows downwards)
DIRECTION_VECTORS = {"left": (-1.0, 0.0), "right": (1.0, 0.0), "up": (0.0, -1.0), "down": (0.0, 1.0)}
NULL_DIGIT, NULL_DIRECTION = 10, len(DIRECTIONS)
_PROMPT_RE = re.compile(r"^\s*(?:a|an|the)?\s*(?:handwritten\s+)?(?:digit\s+)?(\d|" + "|".join(DIGIT_WORDS)
                        + r")\s+moving\s+(" + "|".join(DIRECTIONS) + r")\s*$", re.IGNORECASE)
# Sol-RL exclusions (difrl/quant/linear.py's rule): the pixel projections and the time MLP stay exact
QUANT_PRESET = {"skip": ("x_in", "t_mlp", "x_out"), "min_dim": 0}


def moving_digit_prompt(digit: int, direction: str) -> str:
    return f"a {digit} moving {direction}"


def parse_moving_prompt(prompt: str) -> tuple[int, int]:
    """'a 3 moving left' / 'the digit three moving up' -> (digit, direction index); '' -> the null pair."""
    if prompt.strip() == "":
        return NULL_DIGIT, NULL_DIRECTION
    m = _PROMPT_RE.match(prompt)
    if not m:
        raise ValueError(f"the moving-digits model cannot read the prompt {prompt!r}; write e.g. 'a 3 moving left' "
                         f"(a digit 0-9 or its word, then 'moving' and one of {', '.join(DIRECTIONS)})")
    tok = m.group(1).lower()
    return (int(tok) if tok.isdigit() else DIGIT_WORDS.index(tok)), DIRECTIONS.index(m.group(2).lower())


@dataclass
class VideoNetConfig:
    frames: int = 8
    size: int = 16  # canvas height = width
    patch: int = 16  # p x p pixel patches (16: one token per frame)
    hidden: int = 128
    blocks: int = 3
    heads: int = 4
    mlp_ratio: int = 4


class VideoBlock(nn.Module):
    """adaLN-Zero DiT block over frame tokens: h + g1 * Attn(mod(LN h)); h + g2 * MLP(mod(LN h))."""

    def __init__(self, hidden: int, heads: int, mlp_ratio: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False)
        self.fc1 = nn.Linear(hidden, hidden * mlp_ratio)
        self.fc2 = nn.Linear(hidden * mlp_ratio, hidden)
        self.ada = zero_linear(hidden, 6 * hidden)

    def forward(self, h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """h [B, N tokens, hidden], c [B, hidden] -> [B, N, hidden]."""
        B, F, D = h.shape
        s1, sc1, g1, s2, sc2, g2 = self.ada(c)[:, None].chunk(6, dim=-1)  # each [B, 1, D]
        y = self.norm1(h) * (1 + sc1) + s1
        q, k, v = self.qkv(y).view(B, F, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)  # [B, heads, F, d]
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, F, D)
        h = h + (1 + g1) * self.proj(a)
        y = self.norm2(h) * (1 + sc2) + s2
        return gated_mlp(h, y, g2, self.fc1, self.fc2)


SIGMA_MIN = 0.05  # the velocity's 1 / sigma is clamped here (JiT's t clamp)
POS_INIT_STD = 1.0  # the (frame, patch) position embedding's initial scale (see VideoFlowNet.__init__)


class VideoFlowNet(nn.Module):
    """v_theta(x [B, F, H*W], sigma [B], digit [B], direction [B]) -> [B, F, H*W]: a tiny video DiT.

    Each frame is cut into (H / p) x (W / p) patches of p x p pixels; the F x (H/p)(W/p) patch tokens get a
    learned (frame, patch) position embedding and go through adaLN-Zero blocks of spatio-temporal
    self-attention and an MLP (Wan's layout with a 1-frame tubelet, at toy size). The bundled base uses
    p = 16: one token per frame (8 tokens), the cheapest layout on a CPU, where the attention runs across
    frames only. A token (256 pixels) is then wider than the hidden size (128), so the network predicts the
    clean clip x0_hat and returns the velocity v = (x - x0_hat) / max(sigma, 0.05) (x-prediction with a
    v-loss, Li & He 2025, "Back to Basics: Let Denoising Generative Models Denoise"): a bottleneck can carry
    the clean digit, which lies near a low-dimensional set, but not the 256 pixels of noise that
    v = eps - x0 holds (a v-predicting network of this width leaves the noise in its samples; tried)."""

    def __init__(self, cfg: VideoNetConfig = VideoNetConfig()):
        super().__init__()
        if cfg.size % cfg.patch:
            raise ValueError(f"the canvas size {cfg.size} is not a multiple of the patch size {cfg.patch}")
        self.cfg = cfg
        D, n = cfg.hidden, (cfg.size // cfg.patch) ** 2
        self.x_in = nn.Linear(cfg.patch * cfg.patch, D)
        # token (frame f, patch j) at f * n + j. Unit scale, not ViT's 0.02: the frames must tell themselves apart
        # from the first step for the net to place the digit per frame. At 0.02 the base learned identity first
        # and motion only after ~2,000 steps (motion accuracy 0.09 at 1,000); at 1.0, motion by ~500 steps.
        self.pos_emb = nn.Parameter(torch.randn(cfg.frames * n, D) * POS_INIT_STD)
        self.t_mlp = nn.Sequential(nn.Linear(D, D), nn.SiLU(), nn.Linear(D, D))
        self.digit_emb = nn.Embedding(NULL_DIGIT + 1, D)
        self.dir_emb = nn.Embedding(NULL_DIRECTION + 1, D)
        self.blocks = nn.ModuleList([VideoBlock(D, cfg.heads, cfg.mlp_ratio) for _ in range(cfg.blocks)])
        self.norm_out = nn.LayerNorm(D)
        self.x_out = nn.Linear(D, cfg.patch * cfg.patch)

    def patchify(self, x: torch.Tensor) -> torch.Tensor:
        """[B, F, H*W] -> [B, F * (H/p) * (W/p), p*p]."""
        B, F, p, g = x.shape[0], self.cfg.frames, self.cfg.patch, self.cfg.size // self.cfg.patch
        return x.view(B, F, g, p, g, p).permute(0, 1, 2, 4, 3, 5).reshape(B, F * g * g, p * p)

    def unpatchify(self, t: torch.Tensor) -> torch.Tensor:
        B, F, p, g = t.shape[0], self.cfg.frames, self.cfg.patch, self.cfg.size // self.cfg.patch
        return t.view(B, F, g, g, p, p).permute(0, 1, 2, 4, 3, 5).reshape(B, F, g * p * g * p)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, digit: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
        c = torch.nn.functional.silu(self.t_mlp(sigma_embedding(sigma, self.cfg.hidden)) + self.digit_emb(digit)
                                     + self.dir_emb(direction))
        h = self.x_in(self.patchify(x)) + self.pos_emb
        for block in self.blocks:
            h = block(h, c)
        x0_hat = self.unpatchify(self.x_out(self.norm_out(h)))
        return (x - x0_hat) / sigma.clamp_min(SIGMA_MIN)[:, None, None]


BUNDLED_BASE = Path(__file__).resolve().parent.parent / "assets" / "moving_digits_base.safetensors"


class MovingDigitsPolicy(HoldsNet):
    """FlowPolicy adapter for VideoFlowNet: latents [B, F, H*W] in [-1, 1], videos [B, F, 3, H, W] in [0, 1]."""

    lora_target_modules = ["x_in", "qkv", "proj", "fc1", "fc2", "ada", "x_out"]
    quant_preset = QUANT_PRESET
    block_classes = ("VideoBlock",)  # the repeated blocks: FSDP units (difrl.train.dist.sharding)

    def __init__(self, net: VideoFlowNet):
        self.net = net
        self.latent_shape = (net.cfg.frames, net.cfg.size * net.cfg.size)

    @classmethod
    def from_checkpoint(cls, path: str | Path | None = None) -> "MovingDigitsPolicy":
        path = Path(path) if path else BUNDLED_BASE

        def meta_check(meta: dict) -> None:
            if meta.get("model") != "moving_digits":
                raise ValueError(f"{path} is not a moving-digits generator checkpoint (its metadata has no "
                                 "model=moving_digits; scripts/pretrain_moving_digits.py writes one)")

        return cls(net_from_checkpoint(path, "moving-digits generator checkpoint", VideoNetConfig, VideoFlowNet,
                                       meta_check))

    def encode(self, prompts: list[str]) -> Cond:
        pairs = [parse_moving_prompt(p) for p in prompts]
        return {"digit": torch.tensor([d for d, _ in pairs], dtype=torch.long),
                "direction": torch.tensor([k for _, k in pairs], dtype=torch.long)}

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Cond, guidance: float = 1.0) -> torch.Tensor:
        sigma = torch.as_tensor(sigma, dtype=torch.float32).expand(x.shape[0])
        if guidance == 1.0:
            return self.net(x, sigma, cond["digit"], cond["direction"]).float()
        # classifier-free guidance: one batched pass over [uncond; cond]
        nd, nk = torch.full_like(cond["digit"], NULL_DIGIT), torch.full_like(cond["direction"], NULL_DIRECTION)
        v_u, v_c = self.net(torch.cat([x, x]), torch.cat([sigma, sigma]), torch.cat([nd, cond["digit"]]),
                            torch.cat([nk, cond["direction"]])).float().chunk(2)
        return v_u + guidance * (v_c - v_u)

    def state_dict_and_meta(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """The network's weights and its config as safetensors metadata: a checkpoint from_checkpoint loads."""
        return self.module.state_dict(), {"model": "moving_digits", **{k: str(v) for k, v in vars(self.module.cfg).items()}}

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, F, H*W] in [-1, 1] -> [B, F, 3, H, W] in [0, 1] (grey, the video reward seam's layout)."""
        F, S = self.latent_shape[0], int(round(self.latent_shape[1] ** 0.5))
        frames = ((latents.float() + 1.0) / 2.0).clamp(0.0, 1.0).view(-1, F, 1, S, S)
        return frames.expand(-1, -1, 3, -1, -1).contiguous()

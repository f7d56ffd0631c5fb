"""The digits world's generator: a prompt-conditioned flow-matching residual MLP on 8x8 images.

    policy = DigitsPolicy.from_checkpoint()                      # the bundled weak base model
    cond = policy.encode(["a handwritten 3", "a handwritten seven"])
    v = policy.velocity(x, sigma, cond)                          # x: [B, 64] in the [-1, 1] pixel scale

A residual MLP with adaLN (FiLM) conditioning on (sigma, digit) runs far faster on a CPU than a
DiT at this size. Latents are the 64 pixels scaled from the data's 0..16 to [-1, 1]; decode maps
back to [0, 1] images of shape [B, 1, 8, 8]. Label 10 is the "no prompt" token used for
classifier-free guidance (trained with label dropout).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from difrl.models.base import Cond, HoldsNet
from difrl.quant.linear import QUANT_PRESETS

NULL_LABEL = 10
DIGIT_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
_PROMPT_RE = re.compile(r"^\s*(?:a|an|the)?\s*(?:handwritten\s+)?(?:digit\s+)?(\d|" + "|".join(DIGIT_WORDS) + r")\s*$",
                        re.IGNORECASE)


def digit_prompt(d: int) -> str:
    return f"a handwritten {d}"


def parse_digit_prompt(prompt: str) -> int:
    """'a handwritten 3' / 'the digit three' / '3' -> 3; '' -> NULL_LABEL (unconditional)."""
    if prompt.strip() == "":
        return NULL_LABEL
    m = _PROMPT_RE.match(prompt)
    if not m:
        raise ValueError(f"the digits model cannot read the prompt {prompt!r}; write e.g. 'a handwritten 3' "
                         "or 'the digit three'")
    tok = m.group(1).lower()
    return int(tok) if tok.isdigit() else DIGIT_WORDS.index(tok)


@dataclass
class DigitsNetConfig:
    dim: int = 64  # pixels
    hidden: int = 128
    blocks: int = 3
    mlp_ratio: int = 4
    num_labels: int = 11  # 10 digits + null


def sigma_embedding(sigma: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal features of 1000 * sigma (the DiT timestep embedding on the flow time)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=sigma.device, dtype=torch.float32) / half)
    args = 1000.0 * sigma.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def zero_linear(fan_in: int, fan_out: int) -> nn.Linear:
    """adaLN-Zero's modulation layer (DiT, Peebles & Xie 2023, §3.2): weight and bias start at 0, so every
    (shift, scale, gate) starts at 0. The default init still runs first, so the RNG stream (and with it every
    seeded network built after it) is what it was before this helper."""
    layer = nn.Linear(fan_in, fan_out)
    nn.init.zeros_(layer.weight)
    nn.init.zeros_(layer.bias)
    return layer


def gated_mlp(h: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, fc1: nn.Module, fc2: nn.Module) -> torch.Tensor:
    """The block's MLP residual: h + (1 + gate) * fc2(silu(fc1(y))), y the modulated LN(h) (shapes as h's).
    fc1 / fc2 are passed in at call time: LoRA and the quant module swap replace them on the block."""
    return h + (1 + gate) * fc2(torch.nn.functional.silu(fc1(y)))


class AdaLNBlock(nn.Module):
    """h + gate * MLP(LN(h) * (1 + scale) + shift), with (shift, scale, gate) from the conditioning."""

    def __init__(self, hidden: int, mlp_ratio: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden, elementwise_affine=False)
        self.fc1 = nn.Linear(hidden, hidden * mlp_ratio)
        self.fc2 = nn.Linear(hidden * mlp_ratio, hidden)
        self.ada = zero_linear(hidden, 3 * hidden)

    def forward(self, h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale, gate = self.ada(c).chunk(3, dim=-1)
        y = self.norm(h) * (1 + scale) + shift
        return gated_mlp(h, y, gate, self.fc1, self.fc2)


class DigitsFlowNet(nn.Module):
    """v_theta(x [B, 64], sigma [B], label [B]) -> [B, 64]."""

    def __init__(self, cfg: DigitsNetConfig = DigitsNetConfig()):
        super().__init__()
        self.cfg = cfg
        self.x_in = nn.Linear(cfg.dim, cfg.hidden)
        self.t_mlp = nn.Sequential(nn.Linear(cfg.hidden, cfg.hidden), nn.SiLU(), nn.Linear(cfg.hidden, cfg.hidden))
        self.label_emb = nn.Embedding(cfg.num_labels, cfg.hidden)
        self.blocks = nn.ModuleList([AdaLNBlock(cfg.hidden, cfg.mlp_ratio) for _ in range(cfg.blocks)])
        self.norm_out = nn.LayerNorm(cfg.hidden)
        self.x_out = nn.Linear(cfg.hidden, cfg.dim)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        c = torch.nn.functional.silu(self.t_mlp(sigma_embedding(sigma, self.cfg.hidden)) + self.label_emb(label))
        h = self.x_in(x)
        for block in self.blocks:
            h = block(h, c)
        return self.x_out(self.norm_out(h))


BUNDLED_BASE = Path(__file__).resolve().parent.parent / "assets" / "digits_base.safetensors"


def net_from_checkpoint(path: Path, what: str, config_cls, net_cls, meta_check=None) -> nn.Module:
    """A bundled network from its safetensors: the config's integer fields from the file's metadata, then every
    tensor loaded strictly (a missing or unexpected key names the file as not `what`). `meta_check(meta)` may
    raise first (a checkpoint of another model)."""
    from difrl.utils.io import load_safetensors_checked

    tensors, meta = load_safetensors_checked(path, what=what)
    if meta_check is not None:
        meta_check(meta)
    net = net_cls(config_cls(**{k: int(meta[k]) for k in asdict(config_cls()) if k in meta}))
    missing, unexpected = net.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path} is not a {what}: missing {missing[:4]}, unexpected {unexpected[:4]}")
    return net


class DigitsPolicy(HoldsNet):
    """FlowPolicy adapter for DigitsFlowNet."""

    latent_shape = (64,)
    lora_target_modules = ["x_in", "fc1", "fc2", "ada", "x_out"]
    quant_preset = QUANT_PRESETS["digits"]  # the input/output projections and the time MLP stay exact
    block_classes = ("AdaLNBlock",)  # the repeated blocks: FSDP units (difrl.train.dist.sharding)

    def __init__(self, net: DigitsFlowNet):
        self.net = net

    @classmethod
    def from_checkpoint(cls, path: str | Path | None = None) -> "DigitsPolicy":
        return cls(net_from_checkpoint(Path(path) if path else BUNDLED_BASE, "digits generator checkpoint",
                                       DigitsNetConfig, DigitsFlowNet))

    def encode(self, prompts: list[str]) -> Cond:
        labels = [parse_digit_prompt(p) for p in prompts]
        return {"label": torch.tensor(labels, dtype=torch.long)}

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Cond, guidance: float = 1.0) -> torch.Tensor:
        sigma = torch.as_tensor(sigma, dtype=torch.float32).expand(x.shape[0])
        if guidance == 1.0:
            return self.net(x, sigma, cond["label"]).float()
        # classifier-free guidance: one batched pass over [uncond; cond]
        null = torch.full_like(cond["label"], NULL_LABEL)
        v_u, v_c = self.net(torch.cat([x, x]), torch.cat([sigma, sigma]), torch.cat([null, cond["label"]])).float().chunk(2)
        return v_u + guidance * (v_c - v_u)

    def state_dict_and_meta(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """The network's weights and its config as safetensors metadata: a checkpoint from_checkpoint loads."""
        return self.module.state_dict(), {k: str(v) for k, v in vars(self.module.cfg).items()}

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return ((latents.float() + 1.0) / 2.0).clamp(0.0, 1.0).view(-1, 1, 8, 8)

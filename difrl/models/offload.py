"""Text encoders kept off the device between embeddings (model.offload_text_encoders): where they live, how a load
leaves them there and how an embedding brings them to the transformer's device and back.

    policy = load_flow_policy("flux2", path, device="cuda", offload_text_encoders=True)  # difrl.models.adapters
    with policy.text_encoders_on_device():                                            # what encode() does
        cond = policy._encode_batch(prompts)

FLUX.2 [dev]'s 24-billion-parameter Mistral encoder (44.9 GiB in bf16) would otherwise sit unsharded on every GPU
beside the sharded transformer; `difrl plan` simulates both placements (its offloaded encoders live on "meta", the
simulated host).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch import nn

# where offloaded text encoders live between embeddings (model.offload_text_encoders); difrl plan puts them on "meta"
TEXT_ENCODERS_HOME = torch.device("cpu")
# the home of the text encoders a load in progress keeps off the device (text_encoders_kept_on), None: none kept off
_loading_home: contextvars.ContextVar[torch.device | None] = contextvars.ContextVar("text_encoders_home", default=None)



def loading_home() -> torch.device | None:
    """The home of the text encoders the load in progress keeps off the device (text_encoders_kept_on); None: none."""
    return _loading_home.get()


def is_text_encoder(name: str) -> bool:
    """Whether the pipeline component `name` (an nn.Module) is a text encoder: everything but the transformer(s) (Wan
    2.2 A14B: transformer_2) and the VAE."""
    return not name.startswith(("transformer", "vae"))


@contextlib.contextmanager
def text_encoders_kept_on(home: torch.device | str | None):
    """Inside the block, DiffusersFlowPolicy._load_pipeline moves only the transformer(s) and VAE to the device and
    leaves the text encoders on `home` (None: no change), so a 24-billion-parameter encoder never visits the GPU."""
    token = _loading_home.set(None if home is None else torch.device(home))
    try:
        yield
    finally:
        _loading_home.reset(token)


def move_module(module: nn.Module, device: torch.device) -> None:
    """Move `module`'s parameters and buffers to `device` by replacing them (tied ones stay tied: each tensor is moved
    once). Not Module.to: difrl plan's fake parameters cannot be swapped across device types (meta <-> cpu), and a
    frozen module's parameters are held by no optimizer, so new Parameter objects are safe."""
    moved: dict[int, torch.Tensor] = {}
    for mod in module.modules():
        for table, make in ((mod._parameters, lambda t: nn.Parameter(t, requires_grad=False)), (mod._buffers, None)):
            for key, t in table.items():
                if t is None or t.device == device:
                    continue
                if id(t) not in moved:
                    new = t.detach().to(device)
                    moved[id(t)] = make(new) if make else new
                table[key] = moved[id(t)]


@contextlib.contextmanager
def encoders_visiting(encoders: list[nn.Module], device: torch.device, home: torch.device | None):
    """`encoders` on `device` inside the block, back on `home` after (the accelerator's cache emptied on CUDA, so the
    freed memory is the transformer's again); a no-op when `home` is None (the encoders stay where they are)."""
    if home is None:
        yield
        return
    for comp in encoders:
        move_module(comp, device)
    try:
        yield
    finally:
        for comp in encoders:
            move_module(comp, home)
        if device.type == "cuda":
            torch.cuda.empty_cache()

"""The reward protocol: what a reward model declares, and the helpers every built-in loads with.

    class MyReward(RewardModel):                      # a plain function is a reward too (see difrl.rewards)
        modality = "image"                            # samples [B, 3, H, W] in [0, 1]
        def __init__(self, device="cpu", batch_size=32):
            super().__init__(device=device, dtype="float32", batch_size=batch_size)
        def score(self, images, prompts, metadata):   # one chunk of <= batch_size samples, on self.device
            return images.mean((1, 2, 3))             # [B] float, or {"my_reward": [B], "extra": [B]}

`difrl.rewards.Reward` calls `score` in chunks of `batch_size`, with the samples moved to `device`
and cast to `dtype`, in eval mode under `torch.inference_mode()`, and returns float32 CPU scores.

Modalities (what the samples are):
- "image":  [B, 3, H, W] float in [0, 1];
- "video":  [B, F, 3, H, W] float in [0, 1] (the layout of diffusers' video pipelines);
- "tokens": whatever the masked world decodes to (digits grids, token ids), passed through untouched;
- "any":    no check, no cast (the samples are passed as they are).

Every weight comes from a local path named in the config: `local_file` / `local_dir` check it and
say which option names it; `optional_import` names the extra to install when a package is missing.
A reward that declares its paths, required options and packages (`local_paths`, `required`,
`packages` below) has them checked by `difrl check` before anything loads (difrl.rewards.preflight).
"""

from __future__ import annotations

from pathlib import Path

import torch

from difrl.utils import local as _local
from difrl.utils.io import weights_sha256

MODALITIES = ("image", "video", "tokens", "any")


class RewardConfigError(ValueError):
    """A reward's options are wrong (missing file or directory, unknown choice): nothing was scored."""


def resolve_device(device: str | torch.device | None) -> torch.device:
    """'auto' (or None): the first CUDA device when there is one, else the CPU."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float64": torch.float64, "float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if dtype not in table:
        raise RewardConfigError(f"dtype must be one of {sorted(table)}, got {dtype!r}")
    return table[dtype]


class RewardModel:
    """Base class of reward models that declare where and how they score (a plain function may be a reward
    too: it then scores everything at once, on the CPU, with whatever dtype the samples have).

    Attributes read by `difrl.rewards.Reward`: `modality`, `device`, `dtype`, `batch_size`, `version` and
    `weight_files` (files and save_pretrained directories, hashed by `sha256_files` for run reports and the
    reward server)."""

    modality: str = "image"
    version: str = "1"
    # True when `score` is a differentiable function of the samples (no detach, no PIL / numpy round trip): reward
    # backpropagation (train.objective=draft / refl) needs one and refuses the others (difrl.rewards.differentiable)
    differentiable: bool = False
    # what `difrl check` verifies before anything loads (difrl.rewards.preflight): option -> (what it names, the files
    # its save_pretrained directory holds, or None for a file); options with no usable default; [(package, extra)]
    local_paths: dict[str, tuple[str, tuple[str, ...] | None]] = {}
    required: tuple[str, ...] = ()
    packages: tuple[tuple[str, str], ...] = ()

    def __init__(self, device: str | torch.device | None = "cpu", dtype: str | torch.dtype | None = "float32",
                 batch_size: int | None = 32):
        if batch_size is not None and int(batch_size) < 1:
            raise RewardConfigError(f"batch_size must be >= 1 or null, got {batch_size!r}")
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype)
        self.batch_size = None if batch_size is None else int(batch_size)
        self.weight_files: list[Path] = []

    def score(self, samples, prompts: list[str], metadata: list[dict]):
        """One chunk -> [B] float tensor, or a dict whose entry named like the reward is the [B] score."""
        raise NotImplementedError

    def __call__(self, samples, prompts, metadata=None):
        return self.score(samples, prompts, metadata if metadata is not None else [{} for _ in prompts])


def option_names(option: str, reward: str) -> dict:
    """The reward layer's naming for the path and model helpers (difrl.utils.local, difrl.rewards.vision): the full
    option `reward.options.<reward>.<option>`, who needs it and the error class, as keyword arguments."""
    return {"option": f"reward.options.{reward}.{option}", "who": f"reward {reward!r}", "error": RewardConfigError}


def local_file(path, what: str, option: str, reward: str) -> Path:
    """A weights file that must exist locally; the error names the reward, reward.options.<reward>.<option> and the
    path (difrl.utils.local.local_file with RewardConfigError)."""
    return _local.local_file(path, what, **option_names(option, reward))


def local_dir(path, what: str, option: str, reward: str, needs: tuple[str, ...] = ("config.json",)) -> Path:
    """A `save_pretrained` directory that must exist locally and hold `needs`; the error names what is missing."""
    return _local.local_dir(path, what, **option_names(option, reward), needs=needs)


def optional_import(module: str, extra: str, reward: str, hint: str = ""):
    """Import a package of an optional extra, or say which extra installs it (a RewardConfigError)."""
    return _local.optional_import(module, extra, f"reward {reward!r}", RewardConfigError, hint)


def load_state_dict_file(path, what: str, option: str, reward: str) -> dict[str, torch.Tensor]:
    """{name: tensor} from a local `.safetensors` or torch file, read with `weights_only=True` (no arbitrary
    unpickling). Training-checkpoint wrappers ({"state_dict": ...}, {"model": ...}) are unwrapped and a DDP
    `module.` prefix removed; anything else is a RewardConfigError naming the reward, the option and the path."""
    p = local_file(path, what, option, reward)
    where = f"{str(p)!r} (reward.options.{reward}.{option})"
    try:
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file

            sd = load_file(str(p))
        else:
            sd = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:
        raise RewardConfigError(f"reward {reward!r}: cannot read {what} {where}: {type(e).__name__}: {e}. It is read "
                                "with torch.load(weights_only=True); a file that pickles more than tensors must be "
                                "re-saved as a plain state dict (or .safetensors) by someone who trusts it") from e
    for key in ("state_dict", "model"):
        if isinstance(sd, dict) and isinstance(sd.get(key), dict):
            sd = sd[key]
    if not isinstance(sd, dict) or not all(torch.is_tensor(v) for v in sd.values()):
        raise RewardConfigError(f"reward {reward!r}: {where} holds no state dict (expected {{name: tensor}}, or one "
                                "under 'state_dict' / 'model')")
    if sd and all(k.startswith("module.") for k in sd):
        sd = {k[len("module."):]: v for k, v in sd.items()}
    return sd


def sha256_files(paths) -> str:
    """The identity of a reward's weights (`weight_files`: files and save_pretrained directories), or '' for none:
    difrl.utils.io.weights_sha256, the definition FD extractors use too (one file: its plain SHA-256)."""
    return weights_sha256(paths)

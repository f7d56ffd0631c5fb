"""ImageReward (Xu et al., NeurIPS 2023) as an optional extra: in-process only where its package imports.

    fn = build_reward("imagereward", checkpoint="/w/ImageReward.pt", med_config="/w/med_config.json")
    fn(images [B, 3, H, W] in [0, 1], prompts, metadata)["imagereward"]    # [B], z-scored by the model

The `image-reward` 1.5 package (the last release) does not import with transformers >= 5 (its BLIP
code imports `apply_chunking_to_forward` from `transformers.modeling_utils`, which was removed), pins
timm==0.6.13 (open-clip-torch 3.3 needs timm >= 1.0.17), and its BLIP builds a BERT tokenizer from
the hub id 'bert-base-uncased' (docs/reference/specs/rewards-eval.md §1.4). difrl's own stack therefore cannot run it:
building this reward checks the import first and, when it fails, says so and points to running it
in a separate environment behind a remote reward. Where the package does import, the model loads
from the two local files (`ImageReward.load(name=<file>, med_config=<file>)`) and scores each image
with its prompt (the package truncates text at 35 tokens; its scores are z-normalised).
"""

from __future__ import annotations

import torch

from difrl.rewards import register_reward
from difrl.rewards.base import RewardConfigError, RewardModel, local_file
from difrl.utils.images import to_uint8

INCOMPATIBLE = ("ImageReward cannot run inside difrl's environment: the image-reward package {why}. Its last release "
                "(1.5) needs transformers < 5 and timm==0.6.13, which conflict with difrl's pins. Run it in a separate "
                "environment with image-reward installed and score it remotely (a reward server / `module:function` "
                "client reward), or use another preference reward (hpsv2, pickscore).")


def import_imagereward():
    try:
        import ImageReward  # noqa: N813  (the package's own name)
    except ImportError as e:
        raise RewardConfigError(INCOMPATIBLE.format(why=f"does not import here ({type(e).__name__}: {e})")) from e
    except Exception as e:  # its __init__ imports diffusers/datasets code paths that may fail in other ways
        raise RewardConfigError(INCOMPATIBLE.format(why=f"fails at import ({type(e).__name__}: {e})")) from e
    return ImageReward


@register_reward("imagereward")
class ImageRewardScore(RewardModel):
    """ImageReward (BLIP + MLP, z-scored); needs the image-reward package, which does not import in difrl's stack."""
    modality = "image"
    version = "imagereward-1.0/z"
    local_paths = {"checkpoint": ("the ImageReward checkpoint (ImageReward.pt)", None),
                   "med_config": ("BLIP's med_config.json", None)}
    required = ("checkpoint", "med_config")

    def __init__(self, checkpoint: str | None = None, med_config: str | None = None, device: str = "cpu",
                 batch_size: int | None = 16):
        super().__init__(device=device, dtype="float32", batch_size=batch_size)
        ckpt = local_file(checkpoint, "the ImageReward checkpoint (ImageReward.pt)", "checkpoint", "imagereward")
        med = local_file(med_config, "BLIP's med_config.json", "med_config", "imagereward")
        package = import_imagereward()
        self.model = package.load(name=str(ckpt), med_config=str(med), device=str(self.device)).eval()
        self.weight_files = [ckpt, med]

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        from PIL import Image

        pixels = to_uint8(images).permute(0, 2, 3, 1).cpu().numpy()
        out = [float(self.model.score(p, Image.fromarray(x))) for p, x in zip(prompts, pixels)]
        return torch.tensor(out)

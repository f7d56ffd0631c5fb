"""Feature extractors for Fréchet distances, from local weights only: Inception (FID), CLIP (FD_CLIP), DINOv2
(FD_DINOv2) and any nn.Module (the worlds' classifiers).

    ext = InceptionExtractor("/ckpt/weights-inception-2015-12-05-6726825d.pth")     # FID; antialias=False: TF1 resize
    ext = DinoV2Extractor("/ckpt/dinov2-vitl14")                   # FD_DINOv2 (Dinov2Model.save_pretrained dir)
    ext = ClipExtractor("/ckpt/clip-vit-large-patch14")            # FD_CLIP (CLIPModel dir; processor_dir optional)
    ext = ModuleExtractor(world.classifier, "difrl-digits-cnn-penultimate-64d", method="features")
    gen = extract_features(ext, generated_images)                  # [N, D] float32 on the CPU

Images are [B, 3, H, W] float in [0, 1] (or uint8 in [0, 255]); nothing is downloaded: every extractor loads from a
local file or `save_pretrained` directory, and a missing one is an `EvalConfigError` that names the option and the
path (difrl.utils.local). `weights_sha256` is difrl.utils.io.weights_sha256 of the files read, the definition the
rewards use too (a CLIP reward and a ClipExtractor on the same directory report the same hash).

- FID numbers from different resize paths are different metrics: `InceptionExtractor(antialias=False)` is the
  TF1-compatible bilinear resize of torch-fidelity / pytorch-fid / torchmetrics(antialias=False) that published FIDs
  use; antialias=True is torchmetrics' default. Every report carries {extractor, weights_sha256, resize_mode, n_gen,
  n_ref, ref_stats_sha256} (difrl.eval.reference.fid_report) so that two numbers are only compared when those agree.
- Float images are quantised to uint8 by rounding (difrl.utils.images.to_uint8; what saving a PNG does: diffusers'
  `numpy_to_pil` rounds) before any extractor: FID of in-memory samples equals FID of the saved files. torchmetrics'
  `normalize=True` truncates instead (`(x * 255).byte()`), which shifts pixels by half a level on average.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from difrl.rewards.vision import (OPENAI_MEAN, OPENAI_STD, clip_image_settings, feature_tensor, load_clip_model,
                                  preprocess_clip)
from difrl.utils.images import to_uint8
from difrl.utils.io import state_dict_sha256, weights_sha256
from difrl.utils.local import local_dir, local_file, model_config, optional_import

# ImageNet normalisation of DINOv2 (facebookresearch/dinov2 `dinov2/data/transforms.py` IMAGENET_DEFAULT_MEAN/STD)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class EvalConfigError(ValueError):
    """An evaluation option is wrong (missing weights file or directory, unknown choice): nothing was computed."""


def _eval_import(module: str, who: str):
    """A package of the `eval` extra (torch-fidelity, torchmetrics), or an EvalConfigError saying how to install it."""
    return optional_import(module, "eval", who, EvalConfigError)


# --- feature extractors -------------------------------------------------------------------------------------

class FeatureExtractor(nn.Module):
    """The protocol: `name` (the feature space, with its resize convention), `metric` (the report's metric name:
    "fid", "fd_dinov2", "fd_clip", "fd"), `weights_sha256`, `resize_mode`, `num_features` (D; torchmetrics reads
    it, so any extractor can be passed as `FrechetInceptionDistance(feature=ext)`), and
    `forward(images [B, 3, H, W] in [0, 1] or uint8) -> [B, D] float32`. Always in eval mode."""

    name: str = "extractor"
    metric: str = "fd"
    weights_sha256: str = ""
    resize_mode: str = "none"
    num_features: int = 0

    def train(self, mode: bool = True):
        return super().train(False)

    @property
    def device(self) -> torch.device:
        p = next(iter(list(self.parameters()) + list(self.buffers())), None)
        return p.device if p is not None else torch.device("cpu")

    def info(self) -> dict:
        return {"extractor": self.name, "metric": self.metric, "weights_sha256": self.weights_sha256,
                "resize_mode": self.resize_mode, "dim": int(self.num_features)}


class InceptionExtractor(FeatureExtractor):
    """FID's Inception-v3 (the TF 2015-12-05 graph as ported by torch-fidelity), 2048-d pool3 features, from a local
    `weights-inception-2015-12-05-6726825d.pth` (torch-fidelity's release file; difrl never fetches it).

    antialias=False (default): torch-fidelity's `FeatureExtractorInceptionV3` itself, whose resize to 299 is the
    TF1-compatible bilinear of the original FID code (what published FIDs use). antialias=True: torchmetrics'
    `NoTrainInceptionV3(antialias=True)`, torch's antialiased bilinear, torchmetrics' default FID. Float input is
    rounded to uint8 first (`to_uint8`); both networks take uint8 and scale (x - 128) / 128 inside.

    The file is read once with `torch.load(weights_only=True)` and must be a plain state dict before torch-fidelity
    (which unpickles with weights_only=False) sees it."""

    metric = "fid"

    def __init__(self, weights_path, antialias: bool = False, device="cpu", option: str = "weights_path"):
        super().__init__()
        who = "InceptionExtractor"  # option: the name the user sets weights_path by, for the error (eval.fid.weights)
        path = local_file(weights_path, "the Inception weights (torch-fidelity's "
                          "weights-inception-2015-12-05-6726825d.pth)", option, who, EvalConfigError)
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise EvalConfigError(f"{who}: cannot read {str(path)!r} ({option}) as a plain state dict with "
                                  f"torch.load(weights_only=True): {type(e).__name__}: {e}") from e
        if not isinstance(sd, dict) or "Mixed_7c.branch_pool.conv.weight" not in sd:
            raise EvalConfigError(f"{who}: {str(path)!r} ({option}) is not torch-fidelity's Inception-v3 state "
                                  "dict (no 'Mixed_7c.branch_pool.conv.weight')")
        del sd
        self.antialias = bool(antialias)
        if self.antialias:
            fid_mod = _eval_import("torchmetrics.image.fid", who)
            _eval_import("torch_fidelity", who)
            self.net = fid_mod.NoTrainInceptionV3(name="inception-v3-compat", features_list=["2048"],
                                                  feature_extractor_weights_path=str(path), antialias=True)
        else:
            tf = _eval_import("torch_fidelity.feature_extractor_inceptionv3", who)
            self.net = tf.FeatureExtractorInceptionV3("inception-v3-compat", ["2048"],
                                                      feature_extractor_weights_path=str(path))
        self.net.requires_grad_(False).eval()
        self.weights_path = path
        self.weights_sha256 = weights_sha256([path])  # one file: its plain SHA-256
        self.resize_mode = "uint8-round+" + ("torch-bilinear-antialias-299" if self.antialias else "tf1-bilinear-299")
        self.name = f"inception-v3-tf2015-pool3-2048[{self.resize_mode}]"
        self.num_features = 2048
        self.to(device)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = to_uint8(images)  # [B, 3, H, W] uint8; resized to 299 x 299 inside the network
        out = self.net(x)
        out = out[0] if isinstance(out, (tuple, list)) else out
        return out.reshape(x.shape[0], -1).float()  # [B, 2048]


def save_random_inception_weights(path, seed: int = 0) -> Path:
    """Write a random-weights state dict of torch-fidelity's Inception-v3 (the full 23.9 M parameter architecture;
    95.7 MB) in the layout `FeatureExtractorInceptionV3` loads, for tests: convolutions He-normal so activations keep
    their scale through the 94 layers (default init shrinks them to ~1e-8), batch-norm affine terms perturbed.
    Nothing is downloaded: torch-fidelity's constructor is given an empty state dict, loaded non-strictly."""
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    class _Unloaded(FeatureExtractorInceptionV3):
        def load_state_dict(self, state_dict, strict=True, assign=False):
            return super().load_state_dict(state_dict, strict=False, assign=assign)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    empty = path.with_name(f".{path.name}.empty")
    torch.save({}, empty)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            net = _Unloaded("inception-v3-compat", ["2048"], feature_extractor_weights_path=str(empty))
    finally:
        empty.unlink(missing_ok=True)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.Conv2d):
                fan_in = m.weight[0].numel()
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * math.sqrt(2.0 / fan_in))
            elif isinstance(m, nn.BatchNorm2d):
                m.weight.copy_(1 + 0.1 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    torch.save(net.state_dict(), path)
    return path


class ClipExtractor(FeatureExtractor):
    """FD_CLIP: transformers `CLIPModel.get_image_features` (the projected image embedding, not L2-normalised) from a
    local save_pretrained directory, preprocessed on tensors like the CLIP rewards (difrl.rewards.vision: shortest
    side bicubic with antialias, centre crop, the processor's mean/std). The processor settings come from
    `processor_dir` (or `model_dir`) when it holds preprocessor_config.json, else CLIP's recipe at the model's
    image size with OpenAI's mean/std. Only the vision tower is kept."""

    metric = "fd_clip"

    def __init__(self, model_dir, processor_dir=None, device="cpu", option: str = "model_dir"):
        super().__init__()
        who = "ClipExtractor"
        self.model, mdir = load_clip_model(model_dir, option, who, EvalConfigError, vision_only=True)
        pdir = None
        if processor_dir not in (None, ""):
            pdir = local_dir(processor_dir, "the CLIP image processor", "processor_dir", who, EvalConfigError,
                             needs=("preprocessor_config.json",))
        elif (mdir / "preprocessor_config.json").is_file():
            pdir = mdir
        if pdir is not None:
            self.settings = clip_image_settings(pdir, option if pdir == mdir else "processor_dir", who, EvalConfigError)
        else:
            s = int(self.model.config.vision_config.image_size)
            self.settings = {"size": s, "crop": (s, s), "mean": OPENAI_MEAN, "std": OPENAI_STD}
        self.weights_sha256 = weights_sha256([mdir, pdir])  # the CLIP rewards' definition (their weight_files)
        self.num_features = int(self.model.config.projection_dim)
        crop = self.settings["crop"]
        self.resize_mode = (f"uint8-round+bicubic-antialias-short{self.settings['size']}"
                            + (f"-crop{crop[0]}x{crop[1]}" if crop else "")
                            + ("" if tuple(self.settings["mean"]) == OPENAI_MEAN else "-custom-mean-std"))
        self.name = f"hf-clip[{mdir.name}]-image-embeds-{self.num_features}d[{self.resize_mode}]"
        self.to(device)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = to_uint8(images).float() / 255  # [B, 3, H, W] in [0, 1] on the PNG grid
        x = preprocess_clip(x.to(self.device), self.settings)  # [B, 3, crop_h, crop_w], normalised
        return feature_tensor(self.model.get_image_features(pixel_values=x)).float()  # [B, projection_dim]


def _hub_pos_encoding(emb: nn.Module) -> Callable:
    """facebookresearch/dinov2's `DinoVisionTransformer.interpolate_pos_encoding` (`dinov2/models/vision_transformer.py`,
    interpolate_offset=0.1, no antialias: the hub models' defaults) for a transformers `Dinov2Embeddings`:
    bicubic with scale factor (grid + 0.1) / M. transformers' own version resizes to the target size instead, which
    samples the embedding grid at slightly different points; FD_DINOv2 references (EDM2, dgm-eval) run the hub model."""
    def interpolate_pos_encoding(embeddings: torch.Tensor, height: int, width: int) -> torch.Tensor:
        pos = emb.position_embeddings  # [1, 1 + M*M, D]
        n_patch, n_pos = embeddings.shape[1] - 1, pos.shape[1] - 1
        if n_patch == n_pos and height == width:
            return pos
        ps = emb.patch_size if isinstance(emb.patch_size, int) else emb.patch_size[0]
        m, dim = int(math.sqrt(n_pos)), pos.shape[-1]
        h0, w0 = height // ps + 0.1, width // ps + 0.1
        grid = pos[:, 1:].float().reshape(1, m, m, dim).permute(0, 3, 1, 2)  # [1, D, M, M]
        grid = F.interpolate(grid, scale_factor=(h0 / m, w0 / m), mode="bicubic")  # [1, D, h, w]
        if grid.shape[-2:] != (int(h0), int(w0)):
            raise RuntimeError(f"DINOv2 position grid resized to {tuple(grid.shape[-2:])}, expected {(int(h0), int(w0))}")
        grid = grid.permute(0, 2, 3, 1).reshape(1, -1, dim).to(pos.dtype)
        return torch.cat((pos[:, :1], grid), dim=1)

    return interpolate_pos_encoding


class DinoV2Extractor(FeatureExtractor):
    """FD_DINOv2 (Stein et al. 2023, "Exposing flaws of generative model evaluation metrics"; EDM2's `fd_dinov2`):
    transformers `Dinov2Model` from a local save_pretrained directory (e.g. facebook/dinov2-large), the CLS token
    after the final layer norm (`pooler_output`, the hub model's `x_norm_clstoken`).

    Preprocessing (uint8 images -> float 0..255 -> resize to image_size x image_size -> /255 -> ImageNet mean/std):
    resize="bicubic-antialias" is EDM2's / dgm-eval's fast path (torch bicubic with antialias, no crop);
    "tf1-bilinear" is torch-fidelity's DINOv2 extractor. pos_interp="hub" interpolates the position embeddings like
    the torch.hub model those references run (see `_hub_pos_encoding`); "transformers" keeps transformers' own.
    torch-fidelity's DINOv2 extractor itself cannot load local weights (NotImplementedError), hence this class."""

    metric = "fd_dinov2"

    def __init__(self, model_dir, image_size: int = 224, resize: str = "bicubic-antialias", pos_interp: str = "hub",
                 device="cpu", option: str = "model_dir"):
        super().__init__()
        who = "DinoV2Extractor"
        if resize not in ("bicubic-antialias", "tf1-bilinear"):
            raise EvalConfigError(f"{who}: resize must be 'bicubic-antialias' or 'tf1-bilinear', got {resize!r}")
        if pos_interp not in ("hub", "transformers"):
            raise EvalConfigError(f"{who}: pos_interp must be 'hub' or 'transformers', got {pos_interp!r}")
        from transformers import Dinov2Model

        mdir = local_dir(model_dir, "the DINOv2 model", option, who, EvalConfigError)
        model_config(mdir, option, who, EvalConfigError, model_type="dinov2")
        self.model = Dinov2Model.from_pretrained(str(mdir), local_files_only=True).eval().requires_grad_(False)
        if pos_interp == "hub":
            self.model.embeddings.interpolate_pos_encoding = _hub_pos_encoding(self.model.embeddings)
        if resize == "tf1-bilinear":
            self._tf1 = _eval_import("torch_fidelity.interpolate_compat_tensorflow", who)
        self.image_size, self.resize = int(image_size), resize
        self.weights_sha256 = weights_sha256([mdir])
        self.num_features = int(self.model.config.hidden_size)
        self.resize_mode = f"uint8-round+{resize}-{self.image_size}+imagenet-norm+pos-{pos_interp}"
        self.name = f"hf-dinov2[{mdir.name}]-cls-{self.num_features}d[{self.resize_mode}]"
        self.to(device)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = to_uint8(images).to(self.device).float()  # [B, 3, H, W] in 0..255
        size = (self.image_size, self.image_size)
        if self.resize == "bicubic-antialias":
            x = F.interpolate(x, size=size, mode="bicubic", antialias=True, align_corners=False)
        else:
            x = self._tf1.interpolate_bilinear_2d_like_tensorflow1x(x, size=size, align_corners=False)
        mean = torch.tensor(IMAGENET_MEAN, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(IMAGENET_STD, device=x.device).view(1, 3, 1, 1)
        x = (x / 255 - mean) / std  # [B, 3, S, S]
        return self.model(pixel_values=x).pooler_output.float()  # [B, hidden_size]


class ModuleExtractor(FeatureExtractor):
    """Any nn.Module as a feature extractor (the worlds' classifiers): `method` names the module's function that maps
    a batch to [B, D] features ("forward", or e.g. "features" for difrl.rewards.digits.DigitClassifier's 64-d
    penultimate layer), or is a callable(module, images). Input is passed as it comes (no quantisation, no resize:
    `resize_mode` says what the caller does). `weights_sha256` defaults to the hash of the module's state dict.
    Give `num_features` to pass it to torchmetrics (which otherwise probes the module with a 299 x 299 image)."""

    def __init__(self, module: nn.Module, name: str, method: str | Callable = "forward", metric: str = "fd",
                 weights_sha256: str | None = None, resize_mode: str = "none", num_features: int | None = None):
        super().__init__()
        self.module = module.eval().requires_grad_(False)
        self.method, self.name, self.metric, self.resize_mode = method, str(name), str(metric), str(resize_mode)
        self.weights_sha256 = weights_sha256 or state_dict_sha256(module)
        self.num_features = int(num_features) if num_features else 0  # 0: set by the first batch

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        fn = (lambda x: self.method(self.module, x)) if callable(self.method) else getattr(self.module, self.method)
        out = fn(images).float()
        out = out.reshape(out.shape[0], -1)
        if not self.num_features:
            self.num_features = int(out.shape[1])
        return out


# --- running extractors, reference statistics -----------------------------------------------------------------

def iter_batches(images, batch_size: int) -> Iterable[torch.Tensor]:
    """A tensor [N, ...] in chunks, or an iterable of batches (tensors, (images, labels) pairs, or dicts with
    "images"), or a callable returning such an iterable (called only when the images are needed)."""
    if callable(images) and not torch.is_tensor(images):
        images = images()
    if torch.is_tensor(images):
        for i in range(0, images.shape[0], batch_size):
            yield images[i:i + batch_size]
        return
    for b in images:
        if isinstance(b, dict):
            b = b["images"]
        elif isinstance(b, (tuple, list)):
            b = b[0]
        b = torch.as_tensor(b)
        for i in range(0, b.shape[0], batch_size):
            yield b[i:i + batch_size]


@torch.no_grad()
def extract_features(extractor: nn.Module, images, batch_size: int = 64) -> torch.Tensor:
    """Run `extractor` over `images` (see `iter_batches`) in chunks of `batch_size` on its device: [N, D] float32 CPU."""
    dev = extractor.device if isinstance(extractor, FeatureExtractor) else torch.device("cpu")
    out = [extractor(b.to(dev)).float().cpu() for b in iter_batches(images, int(batch_size))]
    if not out:
        raise ValueError("no images to extract features from")
    return torch.cat(out)

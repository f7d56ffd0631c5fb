"""GenEval's colours: the colour list, the pixel (HSV) and CLIP colour classifiers the `geneval` reward uses.

    from difrl.rewards.geneval_colour import COLORS, CLIPColorClassifier, PixelColorClassifier, pixel_color
    pixel_color(pixels)                                    # [3, N] RGB in [0, 1] -> "blue"
    PixelColorClassifier()(image, detections, "dog")       # image [3, H, W] -> one colour per detection
    CLIPColorClassifier("/ckpt/clip-vit-l-14")(image, detections, "dog")
    classifier, version, weights = build_color_classifier("clip", "/ckpt/clip-vit-l-14")   # what the reward does

A colour classifier is any callable `(image [3, H, W], detections, class_name) -> list[str]` (one colour per
detection), asked only for detections that carry no `color`: "pixel" (HSV pixel vote over the box or mask,
documented in `pixel_color`; a crude stand-in that is right for flat rendered colours), "clip" (GenEval's zero-shot
CLIP classifier on a local transformers CLIP directory), "none" (detections must carry their colour), or a
"module:function" / callable. A `palette` attribute (the colours it can answer) lets the reward refuse a record
asking for a colour the classifier cannot name.
"""

from __future__ import annotations

from typing import Callable

import torch

from difrl.rewards.base import RewardConfigError, local_dir, option_names
from difrl.rewards.geneval_detect import Detection, box_slices, check_mask, load_pluggable
from difrl.rewards.vision import feature_tensor, load_clip_model
from difrl.utils.images import to_uint8

# GenEval's colour list (djghosh13/geneval prompts/create_prompts.py, evaluation/evaluate_images.py).
COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")

# colours_of(detections, class_name) -> one colour per detection: what the rules engine asks about an image
ColorsOf = Callable[[list[Detection], str], list[str]]


def own_colors(dets: list[Detection], class_name: str) -> list[str]:
    """The detections' own `color`s (synthetic worlds); raises when one has none."""
    missing = [d for d in dets if d.color is None]
    if missing:
        raise ValueError(f"GenEval: {len(missing)} {class_name!r} detection(s) carry no colour and no colour "
                         "classifier was given")
    return [d.color for d in dets]


def _hsv(pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[3, N] RGB in [0, 1] -> hue in degrees [0, 360), saturation, value, each [N]."""
    r, g, b = pixels.float()
    mx, mn = pixels.float().max(0).values, pixels.float().min(0).values
    delta = mx - mn
    safe = torch.where(delta > 0, delta, torch.ones_like(delta))
    h = torch.where(mx == r, ((g - b) / safe) % 6, torch.where(mx == g, (b - r) / safe + 2, (r - g) / safe + 4))
    h = torch.where(delta > 0, h * 60.0, torch.zeros_like(h)) % 360
    s = torch.where(mx > 0, delta / torch.where(mx > 0, mx, torch.ones_like(mx)), torch.zeros_like(mx))
    return h, s, mx


def pixel_color(pixels: torch.Tensor) -> str:
    """GenEval colour of a set of pixels [3, N] (RGB in [0, 1]) by a per-pixel HSV vote (our own heuristic):

    - v < 0.2: black; saturation < 0.15 (grey axis): v >= 0.8 white, v < 0.35 black, else grey (no vote);
    - hue h in degrees: [340, 15) red (pink when s < 0.6 and v > 0.7); [15, 45) orange (brown when v < 0.65);
      [45, 70) yellow; [70, 165) green; [165, 255) blue; [255, 300) purple; [300, 340) pink (purple when v < 0.7).

    The colour with most votes wins (ties: GenEval's list order); all grey: white if the mean value >= 0.5, else
    black. Right for flat rendered colours; for photographs use the CLIP classifier (GenEval's)."""
    if pixels.ndim != 2 or pixels.shape[0] != 3 or pixels.shape[1] == 0:
        raise ValueError(f"pixel_color needs [3, N>0] pixels, got {tuple(pixels.shape)}")
    h, s, v = _hsv(pixels)
    idx = {c: i for i, c in enumerate(COLORS)}
    lab = torch.full_like(h, -1, dtype=torch.long)

    def put(cond, name):
        lab[(lab == -1) & cond] = idx[name] if name in idx else -2  # -2: grey, decided (no vote)

    dark, grey = v < 0.2, s < 0.15
    put(dark, "black")
    put(grey & (v >= 0.8), "white")
    put(grey & (v < 0.35), "black")
    put(grey, "grey")
    red = (h >= 340) | (h < 15)
    put(red & (s < 0.6) & (v > 0.7), "pink")
    put(red, "red")
    orange = (h >= 15) & (h < 45)
    put(orange & (v < 0.65), "brown")
    put(orange, "orange")
    put((h >= 45) & (h < 70), "yellow")
    put((h >= 70) & (h < 165), "green")
    put((h >= 165) & (h < 255), "blue")
    put((h >= 255) & (h < 300), "purple")
    magenta = (h >= 300) & (h < 340)
    put(magenta & (v < 0.7), "purple")
    put(magenta, "pink")
    votes = torch.bincount(lab[lab >= 0], minlength=len(COLORS))
    if int(votes.sum()) == 0:
        return "white" if float(v.mean()) >= 0.5 else "black"
    return COLORS[int(votes.argmax())]  # argmax returns the first maximum: GenEval's list order on ties


class PixelColorClassifier:
    """`pixel_color` over each detection's mask pixels inside its box (all box pixels without a mask)."""

    palette = COLORS

    def __call__(self, image: torch.Tensor, detections: list[Detection], class_name: str) -> list[str]:
        _, H, W = image.shape
        out = []
        for d in detections:
            check_mask(d, H, W)
            ys, xs = box_slices(d.box, H, W)
            crop = image[:, ys, xs].reshape(3, -1)  # [3, h*w]
            if d.mask is not None:
                m = d.mask.to(image.device)[ys, xs].reshape(-1)
                if bool(m.any()):
                    crop = crop[:, m]
            out.append(pixel_color(crop))
        return out


class CLIPColorClassifier:
    """GenEval's colour classifier (evaluate_images.py `color_classification`): each detection is pasted on a
    #999 grey background through its mask (if any), cropped to its box, and classified zero-shot among COLORS with
    the templates "a photo of a {c} {object}", "a photo of a {c}-colored {object}", "a photo of a {c} object"
    (clip_benchmark's zero_shot_classifier: per colour, the mean of the L2-normalised template embeddings,
    renormalised). GenEval uses open_clip ViT-L-14 (OpenAI weights); here any transformers CLIP directory."""

    palette = COLORS
    TEMPLATES = ("a photo of a {c} {cls}", "a photo of a {c}-colored {cls}", "a photo of a {c} object")
    BACKGROUND = 153 / 255  # "#999"

    def __init__(self, path, device="cpu"):
        import transformers  # a core dependency of difrl

        d = local_dir(path, "a CLIP model for colours", "clip_model", "geneval")
        try:  # the tokenizer and image-processor files sit next to the weights (save_pretrained of both)
            model, _ = load_clip_model(d, **option_names("clip_model", "geneval"))  # strict, eval
            self.model = model.to(device)
            self.processor = transformers.CLIPProcessor.from_pretrained(str(d), local_files_only=True)
        except RewardConfigError:
            raise
        except (OSError, ValueError) as e:
            raise RewardConfigError(f"reward 'geneval': cannot load a CLIP model and processor from {str(d)!r} "
                                    f"(reward.options.geneval.clip_model): {e}") from e
        self.device = torch.device(device)
        self.path = d
        self._text: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def class_weights(self, class_name: str) -> torch.Tensor:
        """[len(COLORS), D] unit colour embeddings for one object class (cached)."""
        if class_name not in self._text:
            texts = [t.format(c=c, cls=class_name) for c in COLORS for t in self.TEMPLATES]
            tok = self.processor.tokenizer(texts, padding=True, return_tensors="pt").to(self.device)
            f = feature_tensor(self.model.get_text_features(**tok)).float()
            f = torch.nn.functional.normalize(f, dim=-1).view(len(COLORS), len(self.TEMPLATES), -1).mean(1)
            self._text[class_name] = torch.nn.functional.normalize(f, dim=-1)
        return self._text[class_name]

    @torch.no_grad()
    def __call__(self, image: torch.Tensor, detections: list[Detection], class_name: str) -> list[str]:
        from PIL import Image

        if not detections:
            return []
        _, H, W = image.shape
        crops = []
        for d in detections:
            check_mask(d, H, W)
            img = image.float()
            if d.mask is not None:
                img = torch.where(d.mask.to(img.device)[None], img, torch.full_like(img, self.BACKGROUND))
            ys, xs = box_slices(d.box, H, W)
            arr = to_uint8(img[:, ys, xs]).permute(1, 2, 0).cpu().numpy()
            crops.append(Image.fromarray(arr))
        pix = self.processor.image_processor(images=crops, return_tensors="pt")["pixel_values"].to(self.device)
        f = feature_tensor(self.model.get_image_features(pixel_values=pix.to(self.model.dtype))).float()
        logits = torch.nn.functional.normalize(f, dim=-1) @ self.class_weights(class_name).T  # [N, 10]
        return [COLORS[int(i)] for i in logits.argmax(-1)]


def detection_colors(classifier, image: torch.Tensor, asked: set[str]) -> ColorsOf:
    """Colours of detections: their own `color` when set, else `classifier`'s on `image` [3, H, W] (None: every
    detection must carry its colour). `asked`, the colours the record names, must be in the classifier's
    `palette` when it has one."""
    def colors_of(dets: list[Detection], cls: str) -> list[str]:
        need = [d for d in dets if d.color is None]
        got: dict[int, str] = {}
        if need:
            if classifier is None:
                return own_colors(dets, cls)  # raises, naming the class
            palette = getattr(classifier, "palette", None)
            if palette is not None and not asked <= set(palette):
                raise ValueError(f"GenEval: colours {sorted(asked - set(palette))} are not among the colour "
                                 f"classifier's {list(palette)}")
            answers = list(classifier(image, need, cls))
            if len(answers) != len(need):
                raise ValueError(f"GenEval colour classifier returned {len(answers)} colours for {len(need)} "
                                 "detections")
            got = {id(d): c for d, c in zip(need, answers)}
        return [d.color if d.color is not None else got[id(d)] for d in dets]
    return colors_of


def build_color_classifier(color_classifier="pixel", clip_model: str | None = None, device="cpu"):
    """(classifier or None, version, weights path or None) for the reward's `color_classifier` option: "pixel",
    "clip" (with `clip_model`, a local transformers CLIP directory), "none", a 'module:function' path or a
    callable. `clip_model` given to any other classifier raises rather than being ignored."""
    def clip():
        clf = CLIPColorClassifier(clip_model, device)
        return clf, "clip", clf.path

    built = load_pluggable("none" if color_classifier is None else color_classifier, "color_classifier",
                           {"pixel": lambda: (PixelColorClassifier(), "pixel", None), "clip": clip,
                            "none": lambda: (None, "none", None)})
    if color_classifier != "clip" and clip_model:
        raise RewardConfigError("reward 'geneval': clip_model applies to color_classifier='clip' only")
    return built

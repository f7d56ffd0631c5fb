"""GenEval's detections: the `Detection` type and the object detectors the `geneval` reward calls.

    from difrl.rewards.geneval_detect import Detection, SyntheticDetector, TorchvisionDetector, build_detector
    det = TorchvisionDetector("/ckpt/maskrcnn_resnet50_fpn_v2_coco.pth", arch="maskrcnn_resnet50_fpn_v2")
    dets = det(images, ["cat", "dog"])          # images [B, 3, H, W] in [0, 1] -> B lists of Detection
    detector, version, weights = build_detector("torchvision", "/ckpt/maskrcnn.pth")   # what the reward does

A detector is any callable `(images [B, 3, H, W] in [0, 1], class_names: list[str]) -> list[list[Detection]]`
(one list per image; boxes x0, y0, x1, y1 in pixels). It may take a third keyword `metadata` (the samples'
dicts). Built in: "synthetic" (reads `metadata[i]["detections"]`), "torchvision" (a COCO detection model from a
local weights file, COCO names mapped to GenEval's), or a "module:function" path / a callable
(`load_pluggable`, shared with the colour classifiers' option).
`check_mask` and `box_slices` cut a detection's pixels out of its image (the colour classifiers use them).
"""

from __future__ import annotations

import importlib
import inspect
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from difrl.rewards.base import RewardConfigError, load_state_dict_file, optional_import

# GenEval's object names are COCO's 80 (mmdet spelling) except three, renamed for readable prompts
# (geneval `object_names.txt`: "computer mouse", "tv remote", "computer keyboard").
COCO_TO_GENEVAL = {"mouse": "computer mouse", "remote": "tv remote", "keyboard": "computer keyboard"}


@dataclass
class Detection:
    """One detected object. `box` is (x0, y0, x1, y1) in pixels of the scored image; `mask` an optional [H, W]
    bool tensor over the whole image; `color` an optional known colour (synthetic worlds), which then wins over
    the colour classifier."""

    label: str
    score: float
    box: tuple[float, float, float, float]
    mask: torch.Tensor | None = None
    color: str | None = None

    def __post_init__(self):
        self.score = float(self.score)
        box = tuple(float(v) for v in (self.box.tolist() if torch.is_tensor(self.box) else self.box))
        if len(box) != 4 or not all(math.isfinite(v) for v in box) or box[2] < box[0] or box[3] < box[1]:
            raise ValueError(f"detection {self.label!r}: box must be 4 finite numbers x0 <= x1, y0 <= y1, got {self.box!r}")
        if not math.isfinite(self.score):
            raise ValueError(f"detection {self.label!r}: score must be finite, got {self.score!r}")
        self.box = box
        if self.mask is not None and not torch.is_tensor(self.mask):
            self.mask = torch.as_tensor(self.mask)
        if self.mask is not None:
            if self.mask.ndim != 2:
                raise ValueError(f"detection {self.label!r}: mask must be [H, W], got {tuple(self.mask.shape)}")
            self.mask = self.mask.bool()


def as_detection(obj) -> Detection:
    """A Detection from a Detection or a dict {"class" | "label", "box", "score"=1.0, "color"?, "mask"?}."""
    if isinstance(obj, Detection):
        return obj
    if not isinstance(obj, dict):
        raise ValueError(f"a detection must be a Detection or a dict, got {type(obj).__name__}")
    label = obj.get("class", obj.get("label"))
    if not isinstance(label, str) or "box" not in obj:
        raise ValueError(f"a detection dict needs 'class' (or 'label') and 'box' [x0, y0, x1, y1], got keys {sorted(obj)}")
    return Detection(label, obj.get("score", 1.0), obj["box"], obj.get("mask"), obj.get("color"))


def check_mask(d: Detection, h: int, w: int) -> None:
    """Raise unless the detection's mask (if any) is [h, w], the size of the image it was found in."""
    if d.mask is not None and tuple(d.mask.shape) != (h, w):
        raise ValueError(f"detection {d.label!r}: mask {tuple(d.mask.shape)} does not cover the image ({h}, {w})")


def box_slices(box, h: int, w: int) -> tuple[slice, slice]:
    """Integer pixel slices covering an xyxy box, clipped to the image, at least one pixel each way."""
    x0 = min(max(int(math.floor(box[0])), 0), w - 1)
    y0 = min(max(int(math.floor(box[1])), 0), h - 1)
    x1 = max(min(int(math.ceil(box[2])), w), x0 + 1)
    y1 = max(min(int(math.ceil(box[3])), h), y0 + 1)
    return slice(y0, y1), slice(x0, x1)


# ------------------------------------------------------------------------------------------------------- detectors


def load_object(path: str, what: str):
    """The object named by a 'module:attribute' path."""
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise RewardConfigError(f"reward 'geneval': {what} {path!r} must be a built-in name or a 'module:function' path")
    from difrl.rewards import import_user_module  # the package's __init__ imports the built-ins, this one too

    try:
        obj = import_user_module(module)  # also from the current directory
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise RewardConfigError(f"reward 'geneval': cannot load {what} {path!r} ({e})") from e
    if not callable(obj):
        raise RewardConfigError(f"reward 'geneval': {what} {path!r} is not callable")
    return obj


class SyntheticDetector:
    """Ground-truth detections from each sample's metadata (`metadata[i][key]`, default "detections"): a list of
    Detection or dicts {"class", "box": [x0, y0, x1, y1] in pixels, "score"=1.0, "color"?, "mask"?}. For tests and
    bundled worlds that know what they drew. A sample without the key raises (an empty list means nothing)."""

    def __init__(self, key: str = "detections"):
        self.key = key

    def __call__(self, images, class_names, metadata=None) -> list[list[Detection]]:
        if metadata is None:
            raise ValueError("the synthetic GenEval detector reads metadata[i]['detections'] but got no metadata")
        out = []
        for i, m in enumerate(metadata):
            if self.key not in m:
                raise ValueError(f"synthetic GenEval detector: metadata[{i}] has no {self.key!r} list (prompt "
                                 f"{m.get('prompt', '?')!r}); give an empty list for an image with no objects")
            out.append([as_detection(d) for d in m[self.key]])
        return out


# Detection builders of torchvision that take (weights, weights_backbone, num_classes) and return boxes/labels/scores.
TORCHVISION_ARCHS = ("fasterrcnn_resnet50_fpn", "fasterrcnn_resnet50_fpn_v2", "fasterrcnn_mobilenet_v3_large_fpn",
                     "fasterrcnn_mobilenet_v3_large_320_fpn", "maskrcnn_resnet50_fpn", "maskrcnn_resnet50_fpn_v2",
                     "retinanet_resnet50_fpn", "retinanet_resnet50_fpn_v2", "fcos_resnet50_fpn", "ssd300_vgg16",
                     "ssdlite320_mobilenet_v3_large")


class TorchvisionDetector:
    """A torchvision detection model (`arch`, one of TORCHVISION_ARCHS) with weights from a LOCAL file (a state
    dict saved with torch.save or safetensors; never downloaded), e.g. torchvision's
    `maskrcnn_resnet50_fpn_v2_coco-73cbd019.pth`. Labels are COCO's 91 torchvision categories (or `categories`,
    a list with "__background__" first), renamed to GenEval's names by `class_map` (default COCO_TO_GENEVAL).
    `options` go to the builder (e.g. min_size, max_size, box_score_thresh, box_detections_per_img). Mask models
    give masks (probability > 0.5, torchvision's convention) for the colour classifier."""

    def __init__(self, weights, arch: str = "maskrcnn_resnet50_fpn_v2", device="cpu", options: dict | None = None,
                 categories: Sequence[str] | None = None, class_map: dict | None = None):
        tv = optional_import("torchvision", "vision", "geneval")
        det = importlib.import_module("torchvision.models.detection")
        if arch not in TORCHVISION_ARCHS or not hasattr(det, arch):
            raise RewardConfigError(f"reward 'geneval': detector_arch must be one of {TORCHVISION_ARCHS}, got {arch!r}")
        path = weights  # read first: a bad file fails before the model is built
        sd = load_state_dict_file(weights, "torchvision detector weights", "detector_weights", "geneval")
        if categories is None:
            categories = det.FasterRCNN_ResNet50_FPN_Weights.COCO_V1.meta["categories"]  # no download: metadata
        self.categories = list(categories)
        self.class_map = dict(COCO_TO_GENEVAL if class_map is None else class_map)
        model = getattr(det, arch)(weights=None, weights_backbone=None, num_classes=len(self.categories),
                                   **(options or {}))
        result = model.load_state_dict(sd, strict=False)
        if result.missing_keys or result.unexpected_keys:
            raise RewardConfigError(
                f"reward 'geneval': {str(path)!r} does not fit torchvision's {arch} with {len(self.categories)} classes "
                f"(missing {result.missing_keys[:4]}{'...' if len(result.missing_keys) > 4 else ''}, unexpected "
                f"{result.unexpected_keys[:4]}{'...' if len(result.unexpected_keys) > 4 else ''}): set detector_arch "
                "to the file's architecture")
        self.model = model.eval().to(device)
        self.device = torch.device(device)
        self.path, self.arch, self.version = path, arch, f"torchvision-{tv.__version__}-{arch}"

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, class_names: list[str]) -> list[list[Detection]]:
        outs = self.model([im.to(self.device, torch.float32) for im in images])  # list of {boxes [N,4], labels, scores}
        wanted = set(class_names)
        result = []
        for out in outs:
            dets = []
            masks = out.get("masks")  # [N, 1, H, W] probabilities (mask models only)
            for k in range(len(out["scores"])):
                name = self.categories[int(out["labels"][k])]
                name = self.class_map.get(name, name)
                if name not in wanted:
                    continue
                mask = None if masks is None else masks[k, 0] > 0.5
                dets.append(Detection(name, float(out["scores"][k]), out["boxes"][k].tolist(), mask))
            result.append(dets)
        return result


def call_detector(detector, images, class_names, metadata):
    """Call a detector, passing `metadata=` when its signature takes it (or **kwargs)."""
    try:
        target = detector.forward if isinstance(detector, torch.nn.Module) else detector  # Module.__call__ is (*a, **k)
        params = inspect.signature(target).parameters
        takes_meta = "metadata" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    except (TypeError, ValueError):
        takes_meta = False
    return detector(images, class_names, metadata=metadata) if takes_meta else detector(images, class_names)


def load_pluggable(spec, what: str, builtins: dict[str, Callable[[], tuple]]) -> tuple:
    """(object, version, weights path or None) for an option `what` that names a built-in (`builtins[spec]()`
    builds it), is a callable (used as it is) or is a 'module:function' path (`load_object`)."""
    if isinstance(spec, str) and spec in builtins:
        return builtins[spec]()
    if callable(spec):
        return spec, getattr(spec, "__name__", type(spec).__name__), None
    if isinstance(spec, str):
        return load_object(spec, what), spec, None
    names = ", ".join(f"'{name}'" for name in builtins)
    raise RewardConfigError(f"reward 'geneval': {what} must be {names}, a 'module:function' path or a callable, "
                            f"got {spec!r}")


def build_detector(detector="synthetic", weights: str | None = None, arch: str = "maskrcnn_resnet50_fpn_v2",
                   options: dict | None = None, class_map: dict | None = None, device="cpu"):
    """(detector, version, weights path or None) for the reward's `detector` option: "synthetic", "torchvision"
    (`weights`, `arch`, builder `options`, `class_map`), a 'module:function' path or a callable. `weights`,
    `options` and `class_map` given to any other detector raise rather than being ignored."""
    def torchvision():
        det = TorchvisionDetector(weights, arch, device, options, class_map=class_map)
        return det, det.version, det.path

    built = load_pluggable(detector, "detector", {"synthetic": lambda: (SyntheticDetector(), "synthetic", None),
                                                  "torchvision": torchvision})
    if detector != "torchvision" and (weights or options or class_map):
        raise RewardConfigError("reward 'geneval': detector_weights / detector_options / class_map apply to "
                                f"detector='torchvision' only (detector is {detector!r})")
    return built

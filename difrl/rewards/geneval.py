"""GenEval-style compositional reward: detect the objects, then check GenEval's rules (count, colour, position).

    fn = build_reward("geneval", detector="synthetic")       # ground truth from metadata[i]["detections"] (tests, worlds)
    fn = build_reward("geneval", detector="torchvision", detector_weights="/ckpt/maskrcnn_resnet50_fpn_v2_coco.pth",
                      detector_arch="maskrcnn_resnet50_fpn_v2", device="auto")
    fn = build_reward("geneval", detector="mypkg.det:detect", color_classifier="clip", clip_model="/ckpt/clip-vit-l-14")
    out = fn(images, prompts, metadata)   # {"geneval": partial [B], "strict": 0/1 [B], "count", "color", "position",
                                          #  "strict_<tag>", "partial_<tag>" (NaN where not applicable), "objects"}

`metadata[i]` is the GenEval record of the sample's prompt, in GenEval's JSONL schema (djghosh13/geneval
`prompts/evaluation_metadata.jsonl`, flow_grpo `dataset/geneval/*.jsonl`)::

    {"tag": "position", "prompt": "a photo of a cat left of a dog",
     "include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1, "position": ["left of", 0]}],
     "exclude": [{"class": "dog", "count": 2}]}                       # exclude: "fewer than count"

Pieces (each usable alone):
- `GenEvalRules`: a pure-Python rules engine over a record and one image's detections. `strict` is GenEval's
  pass/fail (djghosh13/geneval `evaluation/evaluate_images.py`, `evaluate` + `evaluate_image`): per class, keep
  detections with score > 0.3 (> 0.9 for the "counting" tag), highest first, at most 16, no NMS; an include clause
  passes when its top `count` detections exist, have the colour (if asked) and stand in the relation (if asked)
  to every object of the clause it names; an exclude clause fails when `count` or more are detected. `partial` is
  the partial-credit reward of flow_grpo's reward server (yifan123/reward-server `reward_server/gen_eval.py`,
  `evaluate_reward`), rewards-eval.md §1.7; see `GenEvalRules.evaluate` for its terms and our three documented
  changes. Aspects not asked by a record are NaN (never a sentinel such as the -10 of grouped peer outputs).
- A detector: any callable `(images [B, 3, H, W] in [0, 1], class_names: list[str]) -> list[list[Detection]]`
  (one list per image; boxes x0, y0, x1, y1 in pixels). It may take a third keyword `metadata` (the samples'
  dicts). Built in: "synthetic" (reads `metadata[i]["detections"]`), "torchvision" (a COCO detection model from a
  local weights file, COCO names mapped to GenEval's), or a "module:function" path / a callable.
- A colour classifier `(image [3, H, W], detections, class_name) -> list[str]` for detections that carry no
  `color`: "pixel" (HSV pixel vote over the box or mask, documented in `pixel_color`; a crude stand-in that is
  right for flat rendered colours), "clip" (GenEval's zero-shot CLIP classifier on a local transformers CLIP
  directory), "none" (detections must carry their colour), or a "module:function" / callable.

Failures raise (a malformed record, a detector returning the wrong number of lists, a missing colour): the trainer
then stops or drops the group; nothing becomes a score of 0 (rewards-eval.md §6). Paper-faithful GenEval numbers
need GenEval's Mask2Former + CLIP ViT-L-14 (mmdet 2.x): use the remote reward server for those.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from difrl.rewards import register_reward
from difrl.rewards.base import RewardConfigError, RewardModel, load_state_dict_file, local_dir, optional_import
from difrl.rewards.vision import feature_tensor
from difrl.utils.images import to_uint8

# GenEval's task tags and colour list (djghosh13/geneval prompts/create_prompts.py, evaluation/evaluate_images.py).
TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
RELATIONS = ("left of", "right of", "above", "below")

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


# ----------------------------------------------------------------------------------------------------------- rules


def box_iou(a, b) -> float:
    """IoU of two xyxy boxes with GenEval's inclusive-pixel areas ((x1 - x0 + 1) * (y1 - y0 + 1), `compute_iou`)."""
    def area(x0, y0, x1, y1):
        return max(x1 - x0 + 1, 0) * max(y1 - y0 + 1, 0)
    inter = area(max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3]))
    union = area(*a) + area(*b) - inter
    return inter / union if union else 0.0


def relative_position(box_a, box_b, threshold: float = 0.1) -> set[str]:
    """Relations of A to B (a subset of RELATIONS) from xyxy boxes, GenEval's `relative_position`: the centre
    offset A - B loses `threshold` x (size A + size B) on each axis (clipped at 0, sign kept); if nothing is left
    there is no relation; else the revised offset divided by the norm of the raw offset gives (dx, dy), and
    dx < -0.5: "left of", dx > 0.5: "right of", dy < -0.5: "above", dy > 0.5: "below" (image y grows downward)."""
    (ax0, ay0, ax1, ay1), (bx0, by0, bx1, by1) = box_a[:4], box_b[:4]
    off = ((ax0 + ax1) / 2 - (bx0 + bx1) / 2, (ay0 + ay1) / 2 - (by0 + by1) / 2)
    dims = (abs(ax1 - ax0) + abs(bx1 - bx0), abs(ay1 - ay0) + abs(by1 - by0))
    revised = [math.copysign(max(abs(o) - threshold * d, 0.0), o) for o, d in zip(off, dims)]
    if all(abs(r) < 1e-3 for r in revised):
        return set()
    norm = math.hypot(*off)
    dx, dy = revised[0] / norm, revised[1] / norm
    rels = set()
    if dx < -0.5:
        rels.add("left of")
    if dx > 0.5:
        rels.add("right of")
    if dy < -0.5:
        rels.add("above")
    if dy > 0.5:
        rels.add("below")
    return rels


def check_record(record, where: str = "") -> dict:
    """Validate a GenEval record (raises ValueError saying what is wrong); returns it."""
    at = f" ({where})" if where else ""
    if not isinstance(record, dict):
        raise ValueError(f"GenEval record{at} must be a dict, got {type(record).__name__}")
    include, exclude = record.get("include", []), record.get("exclude", [])
    if not isinstance(include, list) or not isinstance(exclude, list) or not (include or exclude):
        raise ValueError(f"GenEval record{at} needs a non-empty 'include' and/or 'exclude' list of clauses; got keys "
                         f"{sorted(record)} (is metadata[i] the GenEval record of the prompt?)")
    for kind, clauses in (("include", include), ("exclude", exclude)):
        for k, req in enumerate(clauses):
            if not isinstance(req, dict) or not isinstance(req.get("class"), str):
                raise ValueError(f"GenEval record{at}: {kind}[{k}] needs a 'class' name, got {req!r}")
            c = req.get("count")
            if isinstance(c, bool) or not isinstance(c, int) or c < 1:
                raise ValueError(f"GenEval record{at}: {kind}[{k}] needs an integer 'count' >= 1, got {c!r}")
            if kind == "include" and "color" in req and not isinstance(req["color"], str):
                raise ValueError(f"GenEval record{at}: include[{k}] 'color' must be a string, got {req['color']!r}")
            if kind == "include" and "position" in req:
                pos = req["position"]
                if (not isinstance(pos, (list, tuple)) or len(pos) != 2 or pos[0] not in RELATIONS
                        or isinstance(pos[1], bool) or not isinstance(pos[1], int) or not 0 <= pos[1] < k):
                    raise ValueError(f"GenEval record{at}: include[{k}] 'position' must be [relation, index] with "
                                     f"relation in {RELATIONS} and index of an earlier include clause (< {k}), "
                                     f"got {pos!r}")
    return record


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


@dataclass
class GenEvalResult:
    """One image's verdict. `strict`: GenEval's pass/fail. `partial`: the partial-credit reward in [0, 1].
    `count` / `color` / `position`: means of that aspect's terms, NaN when the record asks none of it."""

    strict: bool
    partial: float
    count: float
    color: float
    position: float
    reasons: list[str] = field(default_factory=list)


ColorsOf = Callable[[list[Detection], str], list[str]]


def _colors_from_detections(dets: list[Detection], class_name: str) -> list[str]:
    missing = [d for d in dets if d.color is None]
    if missing:
        raise ValueError(f"GenEval: {len(missing)} {class_name!r} detection(s) carry no colour and no colour "
                         "classifier was given")
    return [d.color for d in dets]


class GenEvalRules:
    """GenEval's selection and rules with its thresholds (evaluate_images.py defaults): `threshold` 0.3,
    `counting_threshold` 0.9 (tag "counting"), `max_objects` 16 per class, `max_overlap` 1.0 (no NMS; below 1 a
    greedy per-class NMS at that IoU, GenEval's `max_overlap` option), `position_threshold` 0.1. `clamp_partial`
    floors each count term at 0 (see `evaluate`)."""

    def __init__(self, threshold: float = 0.3, counting_threshold: float = 0.9, max_objects: int = 16,
                 max_overlap: float = 1.0, position_threshold: float = 0.1, clamp_partial: bool = True):
        for name, v in (("threshold", threshold), ("counting_threshold", counting_threshold),
                        ("max_overlap", max_overlap), ("position_threshold", position_threshold)):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise RewardConfigError(f"reward 'geneval': {name} must be a finite number >= 0, got {v!r}")
        if int(max_objects) < 1:
            raise RewardConfigError(f"reward 'geneval': max_objects must be >= 1, got {max_objects!r}")
        self.threshold, self.counting_threshold = float(threshold), float(counting_threshold)
        self.max_objects, self.max_overlap = int(max_objects), float(max_overlap)
        self.position_threshold, self.clamp_partial = float(position_threshold), bool(clamp_partial)

    def select(self, detections: Sequence, tag: str | None = None) -> dict[str, list[Detection]]:
        """Per class, the detections scoring strictly above the tag's threshold, highest score first, at most
        `max_objects`, then NMS if `max_overlap` < 1 (GenEval's order: threshold, sort, cap, NMS). Equal scores
        keep the detector's order (GenEval's reversed numpy argsort puts the later one first; real detectors'
        scores rarely tie, synthetic ones do, and the listed order is the one a world author expects)."""
        thr = self.counting_threshold if tag == "counting" else self.threshold
        by_class: dict[str, list[Detection]] = defaultdict(list)
        for d in map(as_detection, detections):
            if d.score > thr:
                by_class[d.label].append(d)
        out = {}
        for cls, dets in by_class.items():
            order = sorted(dets, key=lambda d: -d.score)[:self.max_objects]
            kept: list[Detection] = []
            while order:
                best = order.pop(0)
                kept.append(best)
                if self.max_overlap < 1:
                    order = [d for d in order if box_iou(best.box, d.box) < self.max_overlap]
            out[cls] = kept
        return out

    def evaluate(self, record: dict, objects: dict[str, list[Detection]], colors_of: ColorsOf | None = None
                 ) -> GenEvalResult:
        """Score one image's selected `objects` (from `select`) against its GenEval `record`.

        strict: GenEval's `evaluate` exactly (include clauses AND, exclude clauses OR; colour and position on the
        top `count` objects; a position clause needs its target clause to have passed).

        partial: the mean of these terms (reward-server's `evaluate_reward`):
          - per include clause, count: 1 - |count - found| / count over all selected objects of the class
            (floored at 0 when `clamp_partial`; the reward server lets 3 cats for "a cat" score -1);
          - if found != count, each colour / position part of the clause adds a 0 term;
          - else colour: (objects of the asked colour) / count; position: the fraction of (object, target object)
            pairs in the asked relation, or 0 when the target clause did not fully match (right count, colour and
            position). The reward server adds 0 and then 1 for a failed position (a bug) and 1 for a pass; the
            fraction gives the same 1 for a pass and graded credit otherwise;
          - per exclude clause whose class no include clause names, 1 if fewer than count are found, else 0 (the
            reward server ignores exclude clauses; those of GenEval's counting prompts name the included class, so
            the count term already prices them and they add nothing here).
        """
        check_record(record)
        colors_of = colors_of or _colors_from_detections
        color_cache: dict[int, str] = {}

        def colors(dets: list[Detection], cls: str) -> list[str]:
            todo = [d for d in dets if id(d) not in color_cache]
            if todo:
                got = colors_of(todo, cls)
                if len(got) != len(todo):
                    raise ValueError(f"GenEval colour classifier returned {len(got)} colours for {len(todo)} detections")
                color_cache.update({id(d): c for d, c in zip(todo, got)})
            return [color_cache[id(d)] for d in dets]

        include, exclude = record.get("include", []), record.get("exclude", [])
        strict, reasons = True, []
        groups: list[list[Detection] | None] = []          # GenEval's matched_groups (strict)
        partial_groups: list[list[Detection] | None] = []  # the same for the partial reward
        terms, count_terms, color_terms, pos_terms = [], [], [], []
        thr = self.position_threshold
        for req in include:
            cls, c = req["class"], req["count"]
            objs = objects.get(cls, [])
            # --- strict (GenEval evaluate)
            found, ok = objs[:c], True
            if len(found) < c:
                ok = False
                reasons.append(f"expected {cls}>={c}, found {len(found)}")
            else:
                if "color" in req:
                    got = colors(found, cls)
                    if got.count(req["color"]) < c:
                        ok = False
                        reasons.append(f"expected {req['color']} {cls}>={c}, found {got.count(req['color'])} "
                                       f"{req['color']} ({', '.join(got)})")
                if "position" in req and ok:
                    rel, j = req["position"]
                    if groups[j] is None:
                        ok = False
                        reasons.append(f"no target for {cls} to be {rel}")
                    elif not all(rel in relative_position(o.box, t.box, thr) for o in found for t in groups[j]):
                        ok = False
                        reasons.append(f"expected {cls} {rel} target")
            groups.append(found if ok else None)
            strict = strict and ok
            # --- partial (reward-server evaluate_reward, with the changes documented above)
            n = len(objs)
            ct = 1.0 - abs(c - n) / c
            ct = max(ct, 0.0) if self.clamp_partial else ct
            terms.append(ct)
            count_terms.append(ct)
            pok = n == c
            if not pok:
                for aspect, bucket in (("color", color_terms), ("position", pos_terms)):
                    if aspect in req:
                        terms.append(0.0)
                        bucket.append(0.0)
            else:
                if "color" in req:
                    k = colors(objs, cls).count(req["color"])
                    terms.append(k / c)
                    color_terms.append(k / c)
                    pok = k == c
                if "position" in req:
                    rel, j = req["position"]
                    target = partial_groups[j]
                    frac = 0.0 if target is None else _mean(
                        [float(rel in relative_position(o.box, t.box, thr)) for o in objs for t in target])
                    terms.append(frac)
                    pos_terms.append(frac)
                    pok = pok and frac == 1.0
            partial_groups.append(objs if pok else None)
        included = {req["class"] for req in include}
        for req in exclude:
            cls, c = req["class"], req["count"]
            n = len(objects.get(cls, []))
            if n >= c:
                strict = False
                reasons.append(f"expected {cls}<{c}, found {n}")
            if cls not in included:
                terms.append(float(n < c))
        return GenEvalResult(strict, _mean(terms), _mean(count_terms), _mean(color_terms), _mean(pos_terms), reasons)


# --------------------------------------------------------------------------------------------------------- colours


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


def _check_mask(d: Detection, h: int, w: int) -> None:
    if d.mask is not None and tuple(d.mask.shape) != (h, w):
        raise ValueError(f"detection {d.label!r}: mask {tuple(d.mask.shape)} does not cover the image ({h}, {w})")


def _box_slices(box, h: int, w: int) -> tuple[slice, slice]:
    """Integer pixel slices covering an xyxy box, clipped to the image, at least one pixel each way."""
    x0 = min(max(int(math.floor(box[0])), 0), w - 1)
    y0 = min(max(int(math.floor(box[1])), 0), h - 1)
    x1 = max(min(int(math.ceil(box[2])), w), x0 + 1)
    y1 = max(min(int(math.ceil(box[3])), h), y0 + 1)
    return slice(y0, y1), slice(x0, x1)


class PixelColorClassifier:
    """`pixel_color` over each detection's mask pixels inside its box (all box pixels without a mask)."""

    palette = COLORS

    def __call__(self, image: torch.Tensor, detections: list[Detection], class_name: str) -> list[str]:
        _, H, W = image.shape
        out = []
        for d in detections:
            _check_mask(d, H, W)
            ys, xs = _box_slices(d.box, H, W)
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
            self.model = transformers.CLIPModel.from_pretrained(str(d), local_files_only=True).eval().to(device)
            self.processor = transformers.CLIPProcessor.from_pretrained(str(d), local_files_only=True)
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
            _check_mask(d, H, W)
            img = image.float()
            if d.mask is not None:
                img = torch.where(d.mask.to(img.device)[None], img, torch.full_like(img, self.BACKGROUND))
            ys, xs = _box_slices(d.box, H, W)
            arr = to_uint8(img[:, ys, xs]).permute(1, 2, 0).cpu().numpy()
            crops.append(Image.fromarray(arr))
        pix = self.processor.image_processor(images=crops, return_tensors="pt")["pixel_values"].to(self.device)
        f = feature_tensor(self.model.get_image_features(pixel_values=pix.to(self.model.dtype))).float()
        logits = torch.nn.functional.normalize(f, dim=-1) @ self.class_weights(class_name).T  # [N, 10]
        return [COLORS[int(i)] for i in logits.argmax(-1)]


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


def _call_detector(detector, images, class_names, metadata):
    """Call a detector, passing `metadata=` when its signature takes it (or **kwargs)."""
    try:
        target = detector.forward if isinstance(detector, torch.nn.Module) else detector  # Module.__call__ is (*a, **k)
        params = inspect.signature(target).parameters
        takes_meta = "metadata" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    except (TypeError, ValueError):
        takes_meta = False
    return detector(images, class_names, metadata=metadata) if takes_meta else detector(images, class_names)


# ---------------------------------------------------------------------------------------------------------- reward


@register_reward("geneval")
class GenEvalReward(RewardModel):
    """GenEval partial credit as the score; `strict` and the aspects as extras (see the module docstring).

    Options: detector ("synthetic" | "torchvision" | "module:function" | callable), detector_weights,
    detector_arch, detector_options (builder kwargs), class_map (detector name -> GenEval name), color_classifier
    ("pixel" | "clip" | "none" | "module:function" | callable), clip_model (local transformers CLIP directory),
    GenEval's thresholds (threshold, counting_threshold, max_objects, max_overlap, position_threshold),
    clamp_partial, check_prompt (a record whose "prompt" differs from the sample's prompt raises: misaligned
    metadata would otherwise score silently), device, batch_size."""

    modality = "image"

    def __init__(self, detector="synthetic", detector_weights: str | None = None,
                 detector_arch: str = "maskrcnn_resnet50_fpn_v2", detector_options: dict | None = None,
                 class_map: dict | None = None, color_classifier="pixel", clip_model: str | None = None,
                 threshold: float = 0.3, counting_threshold: float = 0.9, max_objects: int = 16,
                 max_overlap: float = 1.0, position_threshold: float = 0.1, clamp_partial: bool = True,
                 check_prompt: bool = True, device="cpu", batch_size: int | None = 16):
        super().__init__(device=device, dtype="float32", batch_size=batch_size)
        self.rules = GenEvalRules(threshold, counting_threshold, max_objects, max_overlap, position_threshold,
                                  clamp_partial)
        self.check_prompt = bool(check_prompt)
        if detector == "synthetic":
            self.detector, det_version = SyntheticDetector(), "synthetic"
        elif detector == "torchvision":
            self.detector = TorchvisionDetector(detector_weights, detector_arch, self.device, detector_options,
                                                class_map=class_map)
            self.weight_files.append(self.detector.path)
            det_version = self.detector.version
        elif callable(detector):
            self.detector, det_version = detector, getattr(detector, "__name__", type(detector).__name__)
        elif isinstance(detector, str):
            self.detector, det_version = load_object(detector, "detector"), detector
        else:
            raise RewardConfigError(f"reward 'geneval': detector must be 'synthetic', 'torchvision', a "
                                    f"'module:function' path or a callable, got {detector!r}")
        if detector != "torchvision" and (detector_weights or detector_options or class_map):
            raise RewardConfigError("reward 'geneval': detector_weights / detector_options / class_map apply to "
                                    f"detector='torchvision' only (detector is {detector!r})")
        if color_classifier == "pixel":
            self.color_classifier, col_version = PixelColorClassifier(), "pixel"
        elif color_classifier == "clip":
            self.color_classifier = CLIPColorClassifier(clip_model, self.device)
            self.weight_files.append(self.color_classifier.path)
            col_version = "clip"
        elif color_classifier in (None, "none"):
            self.color_classifier, col_version = None, "none"
        elif callable(color_classifier):
            self.color_classifier = color_classifier
            col_version = getattr(color_classifier, "__name__", type(color_classifier).__name__)
        elif isinstance(color_classifier, str):
            self.color_classifier, col_version = load_object(color_classifier, "color_classifier"), color_classifier
        else:
            raise RewardConfigError(f"reward 'geneval': color_classifier must be 'pixel', 'clip', 'none', a "
                                    f"'module:function' path or a callable, got {color_classifier!r}")
        if color_classifier != "clip" and clip_model:
            raise RewardConfigError("reward 'geneval': clip_model applies to color_classifier='clip' only")
        self.version = f"1+{det_version}+{col_version}"

    def _colors_of(self, image: torch.Tensor, asked: set[str]) -> ColorsOf:
        """Colours of detections: their own `color` when set, else the classifier's on `image` [3, H, W]."""
        def colors_of(dets: list[Detection], cls: str) -> list[str]:
            need = [d for d in dets if d.color is None]
            got: dict[int, str] = {}
            if need:
                if self.color_classifier is None:
                    return _colors_from_detections(dets, cls)  # raises, naming the class
                palette = getattr(self.color_classifier, "palette", None)
                if palette is not None and not asked <= set(palette):
                    raise ValueError(f"GenEval: colours {sorted(asked - set(palette))} are not among the colour "
                                     f"classifier's {list(palette)}")
                answers = list(self.color_classifier(image, need, cls))
                if len(answers) != len(need):
                    raise ValueError(f"GenEval colour classifier returned {len(answers)} colours for {len(need)} "
                                     "detections")
                got = {id(d): c for d, c in zip(need, answers)}
            return [d.color if d.color is not None else got[id(d)] for d in dets]
        return colors_of

    def score(self, images, prompts, metadata):
        B = images.shape[0]
        records = []
        for i, (p, m) in enumerate(zip(prompts, metadata)):
            rec = check_record(m, f"metadata[{i}], prompt {p!r}")
            if self.check_prompt and isinstance(rec.get("prompt"), str) and rec["prompt"].strip() != p.strip():
                raise ValueError(f"GenEval: metadata[{i}] is the record of the prompt {rec['prompt']!r} but the sample's "
                                 f"prompt is {p!r} (misaligned metadata?); set check_prompt=false if intended")
            records.append(rec)
        class_names = sorted({req["class"] for r in records for req in r.get("include", []) + r.get("exclude", [])})
        detections = _call_detector(self.detector, images, class_names, metadata)
        if not isinstance(detections, (list, tuple)) or len(detections) != B:
            n = len(detections) if isinstance(detections, (list, tuple)) else type(detections).__name__
            raise ValueError(f"GenEval detector returned {n} detection lists for {B} images")
        keys = ["geneval", "strict", "count", "color", "position", "objects"]
        keys += [f"strict_{t}" for t in TAGS] + [f"partial_{t}" for t in TAGS]
        out = {k: torch.full((B,), math.nan, dtype=torch.float32) for k in keys}
        for i, rec in enumerate(records):
            tag = rec.get("tag")
            objects = self.rules.select(detections[i], tag)
            asked = {req["color"] for req in rec.get("include", []) if "color" in req}
            res = self.rules.evaluate(rec, objects, self._colors_of(images[i], asked))
            out["geneval"][i], out["strict"][i] = res.partial, float(res.strict)
            out["count"][i], out["color"][i], out["position"][i] = res.count, res.color, res.position
            out["objects"][i] = sum(len(v) for v in objects.values())
            if tag in TAGS:
                out[f"strict_{tag}"][i], out[f"partial_{tag}"][i] = float(res.strict), res.partial
        return out

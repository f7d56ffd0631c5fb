"""GenEval-style compositional reward: detect the objects, then check GenEval's rules (count, colour, position).

    fn = build_reward("geneval", detector="synthetic")       # ground truth from metadata[i]["detections"] (tests, worlds)
    fn = build_reward("geneval", detector="torchvision", detector_weights="/ckpt/maskrcnn_resnet50_fpn_v2_coco.pth",
                      detector_arch="maskrcnn_resnet50_fpn_v2", device="auto")
    fn = build_reward("geneval", detector="mypkg.det:detect", color_classifier="clip", clip_model="/ckpt/clip-vit-l-14")
    out = fn(images, prompts, metadata)   # {"geneval": partial [B], "strict": 0/1 [B], "count", "color", "position",
                                          #  "strict_<tag>", "partial_<tag>" (NaN where not applicable), "objects"}

Importing this module registers the reward "geneval". `metadata[i]` is the GenEval record of the sample's prompt,
in GenEval's JSONL schema (djghosh13/geneval `prompts/evaluation_metadata.jsonl`, flow_grpo
`dataset/geneval/*.jsonl`)::

    {"tag": "position", "prompt": "a photo of a cat left of a dog",
     "include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1, "position": ["left of", 0]}],
     "exclude": [{"class": "dog", "count": 2}]}                       # exclude: "fewer than count"

Pieces (each usable alone):
- `GenEvalRules` (here): a pure-Python rules engine over a record and one image's detections. `strict` is GenEval's
  pass/fail (djghosh13/geneval `evaluation/evaluate_images.py`, `evaluate` + `evaluate_image`): per class, keep
  detections with score > 0.3 (> 0.9 for the "counting" tag), highest first, at most 16, no NMS; an include clause
  passes when its top `count` detections exist, have the colour (if asked) and stand in the relation (if asked)
  to every object of the clause it names; an exclude clause fails when `count` or more are detected. `partial` is
  the partial-credit reward of flow_grpo's reward server (yifan123/reward-server `reward_server/gen_eval.py`,
  `evaluate_reward`), docs/reference/specs/rewards-eval.md §1.7; see `GenEvalRules.evaluate` for its terms and our three
  documented changes. Aspects not asked by a record are NaN (never a sentinel such as the -10 of grouped peer outputs).
- A detector (`difrl.rewards.geneval_detect`, with the `Detection` type): "synthetic", "torchvision", or a
  "module:function" path / a callable.
- A colour classifier (`difrl.rewards.geneval_colour`) for detections that carry no `color`: "pixel", "clip",
  "none", or a "module:function" path / a callable.

Failures raise (a malformed record, a detector returning the wrong number of lists, a missing colour): the trainer
then stops or drops the group; nothing becomes a score of 0 (docs/reference/specs/rewards-eval.md §6). Paper-faithful
GenEval numbers need GenEval's Mask2Former + CLIP ViT-L-14 (mmdet 2.x): use the remote reward server for those.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

import torch

from difrl.rewards import register_reward
from difrl.rewards.base import RewardConfigError, RewardModel
from difrl.rewards.geneval_colour import ColorsOf, build_color_classifier, detection_colors, own_colors
from difrl.rewards.geneval_detect import Detection, as_detection, build_detector, call_detector

# GenEval's task tags and relations (djghosh13/geneval prompts/create_prompts.py, evaluation/evaluate_images.py).
TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
RELATIONS = ("left of", "right of", "above", "below")


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
        colors_of = colors_of or own_colors
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

    @classmethod
    def preflight(cls, options: dict, who: str, prefix: str) -> list[str]:
        """difrl.rewards.preflight: the torchvision detector needs its weights file and torchvision; the CLIP colour
        classifier its model directory."""
        from difrl.rewards.preflight import declared_problems

        tv = options.get("detector", "synthetic") == "torchvision"
        paths = {"detector_weights": ("torchvision detector weights", None),
                 "clip_model": ("the CLIP model", ("config.json",))}
        return declared_problems(options, who, prefix, paths, ("detector_weights",) if tv else (),
                                 (("torchvision", "vision"),) if tv else ())

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
        self.detector, det_version, det_weights = build_detector(detector, detector_weights, detector_arch,
                                                                 detector_options, class_map, self.device)
        self.color_classifier, col_version, col_weights = build_color_classifier(color_classifier, clip_model,
                                                                                 self.device)
        self.weight_files += [p for p in (det_weights, col_weights) if p is not None]
        self.version = f"1+{det_version}+{col_version}"

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
        detections = call_detector(self.detector, images, class_names, metadata)
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
            res = self.rules.evaluate(rec, objects, detection_colors(self.color_classifier, images[i], asked))
            out["geneval"][i], out["strict"][i] = res.partial, float(res.strict)
            out["count"][i], out["color"][i], out["position"][i] = res.count, res.color, res.position
            out["objects"][i] = sum(len(v) for v in objects.values())
            if tag in TAGS:
                out[f"strict_{tag}"][i], out[f"partial_{tag}"][i] = float(res.strict), res.partial
        return out

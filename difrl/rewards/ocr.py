"""OCR reward: does the image show the text the prompt asks for? (Flow-GRPO's text-rendering task.)

    fn = build_reward("ocr")                                   # rapidocr + its bundled PP-OCRv6 models, offline
    fn = build_reward("ocr", min_confidence=0.8, threads=4)
    out = fn(images, ['a sign that says "Hello World"'], [{}]) # {"ocr": [B] in [0, 1], "edit_distance": [B], ...}

The target is `metadata["text"]` when the sample's metadata has it, else the text inside the first pair of double
quotes of the prompt ("..." or “...”), as in flow_grpo's `ocr.py` (`prompt.split('"')[1]`). A prompt with
neither raises ValueError naming the prompt: there is nothing to score, and a 0 would be a silent failure.

Score (flow_grpo `flow_grpo/ocr.py`, Flow-Factory `rewards/ocr.py`): both texts lose their whitespace and are
lowercased; the recognised text is the engine's pieces (text lines) joined in reading order, keeping only pieces
whose confidence is >= `min_confidence`. If the target is a substring of the recognised text the distance is 0,
else it is the Levenshtein distance, capped at len(target); reward = 1 - distance / len(target), in [0, 1]. An
image where nothing is recognised scores 0: that is a real score (no text), not an error.

Extras (logged as `ocr/<name>`): `edit_distance` (the plain Levenshtein distance between the normalised texts:
no substring shortcut, no cap, so extra junk around a correct text shows), `exact` (1 when the normalised texts are
equal), `confidence` (mean confidence of the kept pieces; NaN when none was kept: not applicable), `pieces`.

Engine: rapidocr (Apache-2.0) on onnxruntime with the PP-OCRv6 det/rec "small" ONNX models that ship inside the
rapidocr wheel: nothing is downloaded (the model paths are given explicitly, so rapidocr's download branch is
never entered). As in flow_grpo (`use_angle_cls=False`) the 180-degree text classifier is off. rapidocr's own
score filter (`Global.text_score`, default 0.5) is set to 0 so that `min_confidence` is the only filter; its
default, 0.5, keeps the engines' behaviour (paddleocr 2.x `drop_score=0.5`, rapidocr `text_score=0.5`), and a
higher value answers flow_grpo#121 (low-confidence junk pollutes the reward). onnxruntime runs with `threads`
intra-op threads (default 1: one thread gives the same result run to run and does not fight the trainer's
threads). Measured on a shared 2-core CPU: about 0.25 s per 512x512 image with 1 thread, 0.2 s with 2; the text
detector scales the shorter side to 736 px, so small or elongated images are not cheaper (256x128: ~0.5 s). Engine errors (onnxruntime failures,
unreadable images) RAISE: flow_grpo and Flow-Factory catch them and score 0
(docs/reference/specs/rewards-eval.md §1.6, §6).
"""

from __future__ import annotations

import logging
import math
import os
import re
from pathlib import Path

import torch

from difrl.rewards import register_reward
from difrl.rewards.base import RewardConfigError, RewardModel, local_file, optional_import
from difrl.rewards.jpeg import to_uint8_hwc

# The first "..." or “...” pair (flow_grpo splits on the ASCII quote only; curly quotes are common in LLM prompts).
_QUOTED = re.compile(r'"([^"]*)"|“([^”]*)”')


def target_text(prompt: str, metadata: dict | None = None) -> str:
    """The text an OCR sample must show: `metadata["text"]` if present, else the first quoted span of the prompt.

    Raises ValueError naming the prompt when there is none (or it is empty)."""
    if metadata and metadata.get("text") is not None:
        text = metadata["text"]
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"OCR reward: metadata['text'] must be a non-empty string, got {text!r} "
                             f"(prompt {prompt!r})")
        return text
    m = _QUOTED.search(prompt)
    if m is None:
        raise ValueError(f"OCR reward: the prompt {prompt!r} has no quoted target text (write it as \"...\") "
                         "and its metadata has no 'text'")
    text = m.group(1) if m.group(1) is not None else m.group(2)
    if not text.strip():
        raise ValueError(f"OCR reward: the quoted target text of the prompt {prompt!r} is empty")
    return text


def normalize_text(text: str) -> str:
    """Lowercase without whitespace (flow_grpo removes ' ' only; tabs and newlines go too here)."""
    return "".join(text.split()).lower()


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions, each of cost 1) by the two-row dynamic programme."""
    if len(a) < len(b):
        a, b = b, a  # keep the row (over b) the shorter one
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1,                # delete ca
                           cur[j - 1] + 1,             # insert cb
                           prev[j - 1] + (ca != cb)))  # substitute (free when equal)
        prev = cur
    return prev[-1]


def ocr_distance(recognized: str, target: str) -> int:
    """Flow-GRPO's distance on normalised texts: 0 if target is a substring of recognized, else the Levenshtein
    distance capped at len(target) (so junk around the text costs at most the whole target)."""
    if target in recognized:
        return 0
    return min(levenshtein(recognized, target), len(target))


def ocr_score(recognized: str, target: str) -> float:
    """1 - distance / len(target) on the normalised texts, in [0, 1]."""
    rec, tgt = normalize_text(recognized), normalize_text(target)
    if not tgt:
        raise ValueError(f"OCR reward: the target text {target!r} is empty once whitespace is removed")
    return 1.0 - ocr_distance(rec, tgt) / len(tgt)


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:  # imported from a source tree: no installed metadata
        return "unknown"


def _bundled_model(pattern: str) -> Path | None:
    """A model file shipped in the rapidocr wheel (rapidocr/models/), or None."""
    import rapidocr

    found = sorted((Path(rapidocr.__file__).parent / "models").glob(pattern))
    return found[-1] if found else None


@register_reward("ocr")
class OCRReward(RewardModel):
    """Flow-GRPO's OCR reward on rapidocr; see the module docstring. Runs on the CPU (onnxruntime)."""

    modality = "image"
    local_paths = {"det_model": ("a text-detection ONNX model", None), "rec_model": ("a text-recognition ONNX model", None)}
    packages = (("rapidocr", "ocr"), ("onnxruntime", "ocr"))

    def __init__(self, min_confidence: float = 0.5, threads: int = 1, det_model: str | None = None,
                 rec_model: str | None = None, batch_size: int | None = 16):
        super().__init__(device="cpu", dtype="float32", batch_size=batch_size)
        if not 0.0 <= float(min_confidence) <= 1.0:
            raise RewardConfigError(f"reward 'ocr': min_confidence must be in [0, 1], got {min_confidence!r}")
        ncpu = os.cpu_count() or 1
        if not 1 <= int(threads) <= ncpu:  # rapidocr silently ignores a count outside [1, cpu_count]
            raise RewardConfigError(f"reward 'ocr': threads must be in [1, {ncpu}] (this machine's CPUs), got {threads!r}")
        self.min_confidence, self.threads = float(min_confidence), int(threads)
        rapidocr = optional_import("rapidocr", "ocr", "ocr")
        ort = optional_import("onnxruntime", "ocr", "ocr", hint="rapidocr needs an inference engine")
        det = local_file(det_model, "a text-detection ONNX model", "det_model", "ocr") if det_model \
            else _bundled_model("*det*.onnx")
        rec = local_file(rec_model, "a text-recognition ONNX model", "rec_model", "ocr") if rec_model \
            else _bundled_model("*rec*.onnx")
        if det is None or rec is None:
            raise RewardConfigError("reward 'ocr': this rapidocr wheel ships no det/rec ONNX models in rapidocr/models "
                                    "(rapidocr>=3.10 does); set reward.options.ocr.det_model and rec_model to local "
                                    "files (difrl never downloads weights)")
        self.weight_files = [det, rec]
        self.version = f"1+rapidocr-{_dist_version('rapidocr')}+onnxruntime-{ort.__version__}+{det.stem}+{rec.stem}"
        params = {
            "Global.log_level": "error",   # rapidocr logs every model path at INFO
            "Global.text_score": 0.0,      # min_confidence filters instead (see the module docstring)
            "Global.use_cls": False,       # flow_grpo: use_angle_cls=False
            "Det.model_path": str(det),
            "Rec.model_path": str(rec),
            "EngineConfig.onnxruntime.intra_op_num_threads": self.threads,
            "EngineConfig.onnxruntime.inter_op_num_threads": 1,
        }
        self.engine = rapidocr.RapidOCR(params=params)
        logging.getLogger("RapidOCR").setLevel(logging.ERROR)

    def read(self, image_hwc) -> tuple[list[str], list[float]]:
        """The engine's text pieces and confidences for one RGB uint8 image [H, W, 3] (unfiltered)."""
        # rapidocr takes numpy arrays as OpenCV BGR (rapidocr/utils/load_image.py) -> flip the channels.
        out = self.engine(image_hwc[..., ::-1].copy())
        txts = list(getattr(out, "txts", None) or ())
        scores = [float(s) for s in (getattr(out, "scores", None) or ())]
        if len(txts) != len(scores):
            raise RuntimeError(f"OCR reward: rapidocr returned {len(txts)} texts but {len(scores)} scores")
        return txts, scores

    def score(self, images, prompts, metadata):
        B = images.shape[0]
        targets = [target_text(p, m) for p, m in zip(prompts, metadata)]  # raises before any OCR work
        arrays = to_uint8_hwc(images, "ocr")  # [B, H, W, 3]
        out = {k: torch.empty(B, dtype=torch.float32) for k in ("ocr", "edit_distance", "exact", "confidence", "pieces")}
        for i in range(B):
            txts, confs = self.read(arrays[i])
            kept = [(t, c) for t, c in zip(txts, confs) if c >= self.min_confidence]
            rec, tgt = normalize_text("".join(t for t, _ in kept)), normalize_text(targets[i])
            if not tgt:
                raise ValueError(f"OCR reward: the target text of the prompt {prompts[i]!r} is empty once whitespace "
                                 "is removed")
            out["ocr"][i] = 1.0 - ocr_distance(rec, tgt) / len(tgt)
            out["edit_distance"][i] = levenshtein(rec, tgt)
            out["exact"][i] = float(rec == tgt)
            out["confidence"][i] = sum(c for _, c in kept) / len(kept) if kept else math.nan
            out["pieces"][i] = len(kept)
        return out

"""Verifiable rewards: OCR (rapidocr, offline), JPEG (in)compressibility (GenEval: tests/test_rewards_geneval.py).

OCR images are rendered here with Pillow. The OCR engine is built once per module (about 1 s; about
0.5 s per image on a 2-core CPU)."""

from __future__ import annotations

import copy
import io
import math

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

import difrl.rewards.jpeg as jpeg_mod  # registers jpeg_compressibility, jpeg_incompressibility
from difrl.rewards import build_reward
from difrl.rewards.base import RewardConfigError
from difrl.rewards.ocr import levenshtein, normalize_text, ocr_distance, ocr_score, target_text

NAN = math.nan


def to_tensor(img: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(img.convert("RGB")).copy()).permute(2, 0, 1).float() / 255.0  # [3, H, W]


def render_text(text: str, size=(256, 256)) -> torch.Tensor:
    img = Image.new("RGB", size, "white")
    ImageDraw.Draw(img).text((12, 110), text, fill="black", font=ImageFont.load_default(size=36))
    return to_tensor(img)


# ---------------------------------------------------------------------------------------------------------- OCR


def test_edit_distance_hand_computed():
    assert levenshtein("kitten", "sitting") == 3  # k->s, e->i, +g
    assert levenshtein("flaw", "lawn") == 2       # -f, +n
    assert levenshtein("", "abc") == levenshtein("abc", "") == 3
    assert levenshtein("abc", "abc") == 0
    assert levenshtein("ab", "ba") == 2           # no transpositions in plain Levenshtein
    assert normalize_text(" Hello \tWorld\n") == "helloworld"
    assert ocr_distance("xxhelloworldyy", "helloworld") == 0   # substring: distance 0
    assert ocr_distance("zzzzzzzzzzzzzzzzzzzz", "abc") == 3    # 20 edits capped at len(target)
    assert ocr_distance("helowrld", "helloworld") == 2
    assert ocr_score("HELLO  WORLD!!", "Hello World") == 1.0
    assert ocr_score("Helo World", "Hello World") == pytest.approx(0.9, rel=1e-12)  # 1 - 1/10 (not binary: float64)
    assert ocr_score("", "Hello World") == 0.0
    assert ocr_score("Goodbye", "abc") == 0.0


def test_target_text_conventions():
    assert target_text('a neon sign saying "Open Late" at night') == "Open Late"
    assert target_text('"A" and then "B"') == "A"                                # the first pair
    assert target_text("a poster reading “Hi there”") == "Hi there"              # curly quotes
    assert target_text("a poster", {"text": "From metadata"}) == "From metadata"  # metadata wins
    assert target_text('a sign "X"', {"text": "Y"}) == "Y"
    with pytest.raises(ValueError, match="a plain prompt"):
        target_text("a plain prompt")
    with pytest.raises(ValueError, match="empty"):
        target_text('an empty "" sign')


@pytest.fixture(scope="module")
def ocr():
    import difrl.rewards.ocr as ocr_mod  # registers ocr

    fn = build_reward("ocr")
    assert isinstance(fn.fn, ocr_mod.OCRReward)
    return fn


def test_ocr_rendered_text(ocr):
    import time

    imgs = torch.stack([render_text("Hello World"), render_text("Goodbye"), render_text(""),
                        render_text("Hello Wrld"), render_text("Hello World")])
    prompts = ['a sign that says "Hello World"'] * 4 + ["a sign with the text from the metadata"]
    meta = [{}] * 4 + [{"text": "hello world"}]
    t0 = time.perf_counter()
    out = ocr(imgs, prompts, meta)
    per_image = (time.perf_counter() - t0) / len(imgs)
    print(f"OCR: {per_image:.3f} s per 256x256 image")
    s = out["ocr"]
    assert s[0] > 0.95 and out["exact"][0] == 1 and out["edit_distance"][0] == 0
    assert s[1] < 0.5                                                    # "goodbye" vs "helloworld"
    assert s[2] == 0.0 and out["pieces"][2] == 0 and math.isnan(out["confidence"][2])  # blank: nothing read
    assert s[3] == pytest.approx(0.9, rel=1e-6) and out["edit_distance"][3] == 1   # one letter missing of 10 (fp32)
    assert s[4] == s[0] and out["confidence"][4] == out["confidence"][0]  # metadata target; same image, same read
    assert 0.9 < out["confidence"][0] <= 1.0
    info = ocr.info()
    assert "rapidocr" in info["version"] and info["weights_sha256"]


def test_ocr_min_confidence_and_errors(ocr):
    fake = copy.copy(ocr.fn)
    fake.read = lambda arr: (["Hello", "Wor", "ld"], [0.99, 0.4, 0.95])
    img = torch.full((1, 3, 16, 16), 1.0)
    out = fake(img, ['"hello world"'], [{}])  # "Wor" (0.4) dropped at the default 0.5: "hellold" -> distance 3
    assert out["ocr"][0] == pytest.approx(0.7, rel=1e-6) and out["pieces"][0] == 2  # fp32 scores of decimal values
    assert out["confidence"][0] == pytest.approx(0.97, rel=1e-6)
    fake.min_confidence = 0.0
    assert fake(img, ['"hello world"'], [{}])["ocr"][0] == 1.0
    with pytest.raises(ValueError, match="no quoted target"):  # raises before any OCR work
        ocr(img, ["a prompt without quotes"], [{}])
    with pytest.raises(ValueError, match="NaN"):
        ocr(torch.full((1, 3, 8, 8), float("nan")), ['"x"'], [{}])
    broken = copy.copy(ocr.fn)

    def engine_error(arr):
        raise RuntimeError("onnxruntime exploded")

    broken.engine = engine_error
    with pytest.raises(RuntimeError, match="exploded"):  # an engine error is never a score of 0
        broken(img, ['"x"'], [{}])
    with pytest.raises(RewardConfigError, match="threads"):
        build_reward("ocr", threads=0)
    with pytest.raises(RewardConfigError, match="min_confidence"):
        build_reward("ocr", min_confidence=2)
    with pytest.raises(RewardConfigError, match="not found"):
        build_reward("ocr", det_model="/nonexistent/det.onnx")


# --------------------------------------------------------------------------------------------------------- JPEG


def test_jpeg_sizes_and_signs():
    g = torch.Generator().manual_seed(0)
    flat = torch.full((3, 64, 64), 0.5)
    noisy = torch.rand(3, 64, 64, generator=g)
    imgs = torch.stack([flat, noisy])
    comp = build_reward("jpeg_compressibility")
    inc = build_reward("jpeg_incompressibility", quality=80, scale=500)
    c, i = comp(imgs, ["", ""]), inc(imgs, ["", ""])
    assert c["jpeg_compressibility"][0] > c["jpeg_compressibility"][1]  # flat compresses better
    assert i["jpeg_incompressibility"][1] > i["jpeg_incompressibility"][0]
    for q, res in ((95, c), (80, i)):
        for k, x in enumerate(imgs):
            arr = (x.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
            buf = io.BytesIO()
            Image.fromarray(arr).save(buf, format="JPEG", quality=q)
            assert res["kb"][k] == pytest.approx(buf.tell() / 1000, abs=1e-3)  # whole bytes / 1000 in fp32
    assert jpeg_mod.jpeg_sizes(imgs, 95) == [round(v * 1000) for v in c["kb"].tolist()]
    assert torch.allclose(c["jpeg_compressibility"], -c["kb"], rtol=0, atol=0)  # exact: a negation
    assert torch.allclose(i["jpeg_incompressibility"], i["kb"] / 500, rtol=1e-6, atol=0)  # fp32 divisions, maybe fused
    assert "pillow" in comp.info()["version"]
    with pytest.raises(ValueError, match="NaN"):
        comp(torch.full((1, 3, 8, 8), float("nan")), [""])
    with pytest.raises(RewardConfigError, match="quality"):
        build_reward("jpeg_compressibility", quality=0)

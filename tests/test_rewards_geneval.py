"""The GenEval reward: its rules engine, colour classifiers, detectors and the reward end to end.

    HF_HUB_OFFLINE=1 python -m pytest -q tests/test_rewards_geneval.py

GenEval detections are written by hand, with the expected strict and partial values computed by hand in the
comments; the torchvision detector and the CLIP colour classifier are tiny models built here with random weights."""

from __future__ import annotations

import math

import pytest
import torch

from difrl.rewards import build_reward
from difrl.rewards.base import RewardConfigError
from difrl.rewards.geneval import GenEvalRules, relative_position
from difrl.rewards.geneval_colour import COLORS, CLIPColorClassifier, PixelColorClassifier, pixel_color
from difrl.rewards.geneval_detect import Detection
from difrl.rewards.vision import feature_tensor

# GenEval scores are fractions of a few rule terms: compared exactly where the fraction is dyadic (0, 1/2, 3/4, 1:
# exact in binary), with rel 1e-6 where it is not (2/3 rounds once, to 6e-8 relative in a float32 tensor).


# ------------------------------------------------------------------------------------------------- GenEval rules


def det(cls, box=(0, 0, 10, 10), score=0.95, color=None, mask=None):
    return Detection(cls, score, box, mask, color)


def run(record, dets, **opts):
    rules = GenEvalRules(**opts)
    return rules.evaluate(record, rules.select(dets, record.get("tag")))


SINGLE = {"tag": "single_object", "include": [{"class": "dog", "count": 1}], "prompt": "a photo of a dog"}


def test_single_object_counts_and_clamp():
    r = run(SINGLE, [det("dog")])
    assert r.strict and r.partial == 1.0 and r.count == 1.0 and math.isnan(r.color) and math.isnan(r.position)
    r = run(SINGLE, [])
    assert not r.strict and r.partial == 0.0
    r = run(SINGLE, [det("dog"), det("dog")])  # GenEval: at least `count` passes; partial 1 - |1 - 2|/1 = 0
    assert r.strict and r.partial == 0.0
    three = [det("dog")] * 3                   # 1 - |1 - 3|/1 = -1: floored at 0 unless clamp_partial=False
    assert run(SINGLE, three).partial == 0.0 and run(SINGLE, three, clamp_partial=False).partial == -1.0
    r = run(SINGLE, [det("cat")])
    assert not r.strict and r.partial == 0.0


def test_detection_thresholds():
    assert not run(SINGLE, [det("dog", score=0.29)]).strict  # below 0.3: ignored
    assert not run(SINGLE, [det("dog", score=0.3)]).strict   # GenEval keeps score > 0.3, strictly
    assert run(SINGLE, [det("dog", score=0.31)]).strict
    rules = GenEvalRules()
    many = [det("dog", score=0.5 + i / 100) for i in range(20)]
    kept = rules.select(many)["dog"]
    assert len(kept) == 16 and [d.score for d in kept] == sorted((d.score for d in many), reverse=True)[:16]
    a, b = det("dog", (0, 0, 100, 100), 0.9), det("dog", (2, 2, 100, 100), 0.8)  # IoU ~0.96
    assert len(rules.select([a, b])["dog"]) == 2                        # GenEval default: no NMS
    assert len(GenEvalRules(max_overlap=0.5).select([a, b])["dog"]) == 1


COUNT3 = {"tag": "counting", "include": [{"class": "cat", "count": 3}], "exclude": [{"class": "cat", "count": 4}],
          "prompt": "a photo of three cats"}


def test_counting():
    dets = [det("cat", score=0.95)] * 3 + [det("cat", score=0.85)]
    r = run(COUNT3, dets)  # counting threshold 0.9 drops the 0.85 cat: exactly 3
    assert r.strict and r.partial == 1.0
    r = run(dict(COUNT3, tag="two_object"), dets)  # at 0.3 all 4 count: the exclude clause fails
    assert not r.strict and r.partial == pytest.approx(1 - 1 / 3, rel=1e-6)  # exclude names the included class: no term
    r = run(COUNT3, [det("cat")] * 2)
    assert not r.strict and r.partial == pytest.approx(2 / 3, rel=1e-6) and r.count == pytest.approx(2 / 3, rel=1e-6)
    r = run(COUNT3, [det("cat", score=0.89)] * 3)  # all below 0.9
    assert not r.strict and r.partial == 0.0


def test_exclude_of_another_class():
    rec = {"tag": "single_object", "include": [{"class": "dog", "count": 1}], "exclude": [{"class": "cat", "count": 1}]}
    r = run(rec, [det("dog"), det("cat")])
    assert not r.strict and r.partial == 0.5  # terms: dog count 1, "no cat" 0
    r = run(rec, [det("dog")])
    assert r.strict and r.partial == 1.0


def test_colors_and_color_attr():
    rec = {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}]}
    r = run(rec, [det("car", color="red")])
    assert r.strict and r.partial == 1.0 and r.color == 1.0
    r = run(rec, [det("car", color="blue")])
    assert not r.strict and r.partial == 0.5 and r.color == 0.0  # terms: count 1, colour 0
    r = run(rec, [])
    assert not r.strict and r.partial == 0.0 and r.color == 0.0  # count 0, colour 0 (not asked of nothing)
    r = run(rec, [det("car", color="red"), det("car", color="red")])
    assert r.strict and r.partial == 0.0  # strict: top 1 is red; partial: count 1-1/1 = 0, colour 0
    attr = {"tag": "color_attr", "include": [{"class": "bus", "count": 1, "color": "red"},
                                             {"class": "cake", "count": 1, "color": "blue"}]}
    r = run(attr, [det("bus", color="red"), det("cake", color="green")])
    assert not r.strict and r.partial == 0.75 and r.color == 0.5 and r.count == 1.0  # terms 1, 1, 1, 0
    two = {"tag": "colors", "include": [{"class": "car", "count": 2, "color": "red"}]}
    r = run(two, [det("car", color="red"), det("car", color="blue")])
    assert not r.strict and r.partial == 0.75 and r.color == 0.5  # terms: count 1, colour 1/2
    with pytest.raises(ValueError, match="no colour"):
        run(rec, [det("car")])  # no colour and no classifier: an error, not a 0


CAT, DOG = (10, 40, 50, 80), (150, 40, 190, 80)  # cat left of dog (same row)
UP, DOWN = (100, 0, 140, 40), (100, 150, 140, 190)


@pytest.mark.parametrize("rel, cat, dog", [("left of", CAT, DOG), ("right of", DOG, CAT),
                                           ("above", UP, DOWN), ("below", DOWN, UP)])
def test_position_relations(rel, cat, dog):
    rec = {"tag": "position", "include": [{"class": "dog", "count": 1},
                                          {"class": "cat", "count": 1, "position": [rel, 0]}]}
    r = run(rec, [det("cat", cat), det("dog", dog)])
    assert r.strict and r.partial == 1.0 and r.position == 1.0
    r = run(rec, [det("cat", dog), det("dog", cat)])  # swapped: the opposite relation
    assert not r.strict and r.partial == pytest.approx(2 / 3, rel=1e-6) and r.position == 0.0  # terms 1, 1, 0


def test_position_geometry_and_targets():
    assert relative_position((0, 0, 10, 10), (100, 0, 110, 10)) == {"left of"}  # dx = -(100 - 2)/100
    assert relative_position((0, 0, 10, 10), (20, 20, 30, 30)) == {"left of", "above"}  # dx = dy = -18/28.3
    assert relative_position((0, 0, 40, 40), (5, 0, 45, 40)) == set()  # |5| - 0.1 * 80 < 0: no relation
    assert relative_position((0, 0, 10, 10), (0, 0, 10, 10)) == set()
    # (-30, -5) offset: revised (-28, -3)/30.4 = (-0.92, -0.10): left only
    assert relative_position((0, 0, 10, 10), (30, 5, 40, 15)) == {"left of"}
    rec = {"tag": "position", "include": [{"class": "dog", "count": 1},
                                          {"class": "cat", "count": 1, "position": ["left of", 0]}]}
    r = run(rec, [det("cat", CAT)])  # no dog: no target
    assert not r.strict and r.partial == pytest.approx(1 / 3, rel=1e-6) and r.position == 0.0  # terms 0, 1, 0
    assert any("no target" in s for s in r.reasons)
    two = {"tag": "position", "include": [{"class": "dog", "count": 1},
                                          {"class": "cat", "count": 2, "position": ["left of", 0]}]}
    r = run(two, [det("dog", DOG), det("cat", CAT), det("cat", (200, 40, 240, 80))])
    assert not r.strict and r.position == 0.5 and r.partial == pytest.approx(2.5 / 3, rel=1e-6)  # terms 1, 1, 1/2 pairs


def test_record_validation():
    for bad, msg in [({"tag": "x"}, "include"), ({"include": [{"class": "dog", "count": 0}]}, "count"),
                     ({"include": [{"class": "dog", "count": 1, "position": ["left of", 0]}]}, "earlier"),
                     ({"include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1,
                                                                 "position": ["near", 0]}]}, "relation"),
                     ({"include": [{"count": 1}]}, "class")]:
        with pytest.raises(ValueError, match=msg):
            run(bad, [])
    with pytest.raises(ValueError, match="box"):
        Detection("dog", 0.9, (10, 0, 0, 10))
    with pytest.raises(RewardConfigError, match="max_objects"):
        GenEvalRules(max_objects=0)


def test_pixel_colors():
    protos = {"red": (220, 20, 30), "orange": (255, 140, 0), "yellow": (250, 220, 30), "green": (30, 160, 50),
              "blue": (30, 60, 200), "purple": (120, 40, 160), "pink": (255, 150, 200), "brown": (120, 70, 30),
              "black": (15, 15, 15), "white": (245, 245, 245)}
    assert set(protos) == set(COLORS)
    for name, rgb in protos.items():
        px = torch.tensor(rgb, dtype=torch.float32)[:, None].expand(3, 50) / 255
        assert pixel_color(px) == name, name
    grey = torch.full((3, 10), 0.6)
    assert pixel_color(grey) == "white" and pixel_color(torch.full((3, 10), 0.4)) == "black"
    img = torch.ones(3, 64, 64)
    img[:, 10:30, 10:30] = torch.tensor([0.1, 0.2, 0.9])[:, None, None]  # a blue square on white
    clf = PixelColorClassifier()
    assert clf(img, [det("x", (10, 10, 30, 30))], "x") == ["blue"]
    assert clf(img, [det("x", (0, 0, 64, 64))], "x") == ["white"]       # box mostly background
    mask = torch.zeros(64, 64, dtype=torch.bool)
    mask[10:30, 10:30] = True
    assert clf(img, [det("x", (0, 0, 64, 64), mask=mask)], "x") == ["blue"]  # the mask selects the object


# ------------------------------------------------------------------------------------------ GenEval, end to end


def fixed_detector(images, class_names):
    """A 'module:function' detector: one dog per image, without a colour (the pixel classifier colours it)."""
    return [[Detection("dog", 0.99, (8, 8, 24, 24))] for _ in range(images.shape[0])]


def test_geneval_reward_synthetic():
    fn = build_reward("geneval", detector="synthetic")
    img = torch.ones(3, 64, 64)
    img[:, 8:24, 8:24] = torch.tensor([0.9, 0.1, 0.1])[:, None, None]  # a red square where the car is
    records = [
        dict(SINGLE, detections=[{"class": "dog", "box": [0, 0, 10, 10], "score": 0.9}]),
        dict(COUNT3, detections=[{"class": "cat", "box": [0, 0, 5, 5]}] * 2),
        {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}], "prompt": "a photo of a red car",
         "detections": [{"class": "car", "box": [8, 8, 24, 24]}]},  # no colour given: the pixel classifier says red
        {"tag": "position", "prompt": "a photo of a cat left of a dog",
         "include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1, "position": ["left of", 0]}],
         "detections": [{"class": "cat", "box": list(DOG)}, {"class": "dog", "box": list(CAT)}]},
    ]
    out = fn(torch.stack([img] * 4), [r["prompt"] for r in records], records)
    assert out["geneval"].tolist() == pytest.approx([1.0, 2 / 3, 1.0, 2 / 3], rel=1e-6)
    assert out["strict"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert out["color"][2] == 1.0 and math.isnan(out["color"][0]) and out["position"][3] == 0.0
    assert out["strict_single_object"][0] == 1.0 and torch.isnan(out["strict_single_object"][1:]).all()
    assert out["partial_counting"][1] == pytest.approx(2 / 3, rel=1e-6) and math.isnan(out["strict_counting"][0])
    assert torch.isnan(out["strict_two_object"]).all()  # no two_object sample: not applicable, never -10
    assert out["objects"].tolist() == [1, 2, 1, 2]
    for k, v in out.items():
        assert v.dtype == torch.float32 and v.shape == (4,), k

    with pytest.raises(ValueError, match="no 'detections'"):
        fn(img[None], [SINGLE["prompt"]], [dict(SINGLE)])
    with pytest.raises(ValueError, match="misaligned"):
        fn(img[None], ["a photo of a cat"], [records[0]])
    assert build_reward("geneval", check_prompt=False)(img[None], ["another"], [records[0]])["geneval"][0] == 1.0
    with pytest.raises(ValueError, match="no colour"):
        build_reward("geneval", color_classifier="none")(img[None], [records[2]["prompt"]], [records[2]])
    odd = dict(records[2], include=[{"class": "car", "count": 1, "color": "teal"}])
    with pytest.raises(ValueError, match="teal"):  # the pixel classifier cannot say "teal": an error, not a 0
        fn(img[None], [odd["prompt"]], [odd])


def test_geneval_custom_detector_and_errors():
    fn = build_reward("geneval", detector=f"{__name__}:fixed_detector")
    img = torch.ones(2, 3, 32, 32)
    img[:, :, 8:24, 8:24] = torch.tensor([0.1, 0.7, 0.2])[:, None, None]  # green
    rec = {"tag": "colors", "include": [{"class": "dog", "count": 1, "color": "green"}]}
    out = fn(img, ["a", "b"], [rec, dict(rec, include=[{"class": "dog", "count": 1, "color": "red"}])])
    assert out["geneval"].tolist() == [1.0, 0.5] and out["strict"].tolist() == [1.0, 0.0]

    class ModuleDetector(torch.nn.Module):  # an nn.Module detector: called with (images, class_names) only
        def forward(self, images, class_names):
            return fixed_detector(images, class_names)

    assert build_reward("geneval", detector=ModuleDetector())(img, ["a", "b"], [rec, rec])["strict"].tolist() == [1, 1]
    bad_mask = {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}],
                "detections": [{"class": "car", "box": [0, 0, 4, 4], "mask": torch.ones(8, 8, dtype=torch.bool)}]}
    with pytest.raises(ValueError, match="does not cover"):
        build_reward("geneval")(img[:1], ["a"], [bad_mask])

    def short(images, class_names):
        return []

    with pytest.raises(ValueError, match="0 detection lists for 2"):
        build_reward("geneval", detector=short)(img, ["a", "b"], [rec, rec])

    def crash(images, class_names):
        raise RuntimeError("detector down")

    with pytest.raises(RuntimeError, match="detector down"):
        build_reward("geneval", detector=crash)(img, ["a", "b"], [rec, rec])
    with pytest.raises(RewardConfigError, match="cannot load"):
        build_reward("geneval", detector="no_such_module_xyz:detect")
    with pytest.raises(RewardConfigError, match="detector_weights"):
        build_reward("geneval", detector="torchvision")
    with pytest.raises(RewardConfigError, match="torchvision' only"):
        build_reward("geneval", detector_weights="/x.pth")


def always_red(image, detections, class_name):
    """A 'module:function' colour classifier."""
    return ["red"] * len(detections)


def test_geneval_pluggable_options():
    """detector / color_classifier each take a built-in name, a callable or a 'module:function' path; the reward's
    version names what was used, and anything else (or an option for another choice) raises naming the option."""
    img = torch.ones(1, 3, 32, 32)
    rec = {"tag": "colors", "include": [{"class": "dog", "count": 1, "color": "red"}]}
    assert build_reward("geneval").info()["version"] == "1+synthetic+pixel"
    assert build_reward("geneval", color_classifier=None).info()["version"] == "1+synthetic+none"
    fn = build_reward("geneval", detector=fixed_detector, color_classifier=f"{__name__}:always_red")
    assert fn.info()["version"] == f"1+fixed_detector+{__name__}:always_red"
    assert fn(img, ["a"], [rec])["strict"].tolist() == [1.0]  # white pixels, but the classifier says red
    assert build_reward("geneval", detector=fixed_detector, color_classifier=always_red)(img, ["a"], [rec])[
        "strict"].tolist() == [1.0]
    with pytest.raises(RewardConfigError, match="^reward 'geneval': detector must be 'synthetic', 'torchvision', a "
                                                "'module:function' path or a callable, got 3$"):
        build_reward("geneval", detector=3)
    with pytest.raises(RewardConfigError, match="^reward 'geneval': color_classifier must be 'pixel', 'clip', 'none', "
                                                "a 'module:function' path or a callable, got 3$"):
        build_reward("geneval", color_classifier=3)
    with pytest.raises(RewardConfigError, match="clip_model applies to color_classifier='clip' only"):
        build_reward("geneval", clip_model="/ckpt/clip")
    with pytest.raises(RewardConfigError, match="torchvision' only"):
        build_reward("geneval", detector=fixed_detector, class_map={"mouse": "computer mouse"})
    with pytest.raises(RewardConfigError, match="module:function"):
        build_reward("geneval", color_classifier="rainbow")


def test_geneval_torchvision_detector(tmp_path):
    """A randomly initialised torchvision detector whose box head always says COCO 'mouse' (index 74): the reward
    loads it from a local file, maps 'mouse' to GenEval's 'computer mouse', and scores."""
    pytest.importorskip("torchvision")
    from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_320_fpn

    torch.manual_seed(0)
    model = fasterrcnn_mobilenet_v3_large_320_fpn(weights=None, weights_backbone=None, num_classes=91)
    head = model.roi_heads.box_predictor
    with torch.no_grad():
        head.cls_score.weight.zero_()
        head.cls_score.bias.zero_()
        head.cls_score.bias[74] = 20.0  # softmax ~1 on "mouse"
        head.bbox_pred.weight.zero_()
        head.bbox_pred.bias.zero_()     # boxes = the RPN's proposals
    path = tmp_path / "det.pth"
    torch.save(model.state_dict(), path)
    opts = {"min_size": 128, "max_size": 128, "box_detections_per_img": 5}
    fn = build_reward("geneval", detector="torchvision", detector_weights=str(path),
                      detector_arch="fasterrcnn_mobilenet_v3_large_320_fpn", detector_options=opts)
    assert fn.info()["weights_sha256"]
    img = torch.rand(1, 3, 96, 96, generator=torch.Generator().manual_seed(0))
    rec = {"tag": "single_object", "include": [{"class": "computer mouse", "count": 1}]}
    raw = fn.fn.detector(img, ["computer mouse"])
    assert len(raw) == 1 and raw[0] and all(d.label == "computer mouse" and d.score > 0.99 for d in raw[0])
    assert all(0 <= v <= 96 for d in raw[0] for v in d.box)
    out = fn(img, ["a photo of a computer mouse"], [rec])
    assert out["strict"][0] == 1.0 and 1 <= out["objects"][0] <= 5
    assert out["geneval"][0] == max(0.0, 1 - abs(1 - out["objects"][0].item()))
    bad = tmp_path / "bad.pth"
    torch.save({"foo": torch.zeros(1)}, bad)
    with pytest.raises(RewardConfigError, match="does not fit"):
        build_reward("geneval", detector="torchvision", detector_weights=str(bad),
                     detector_arch="fasterrcnn_mobilenet_v3_large_320_fpn")
    with pytest.raises(RewardConfigError, match="not found"):
        build_reward("geneval", detector="torchvision", detector_weights=str(tmp_path / "missing.pth"))
    with pytest.raises(RewardConfigError, match="detector_arch"):
        build_reward("geneval", detector="torchvision", detector_weights=str(path), detector_arch="resnet50")



def save_tiny_clip(directory) -> str:
    """A randomly initialised 1-layer CLIP with a letters-only BPE vocabulary (no merges), saved with
    save_pretrained: enough to run GenEval's zero-shot colour classifier end to end (its answers are random)."""
    import json

    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["-"]
    vocab = {t: i for i, t in enumerate(letters + [c + "</w>" for c in letters] + ["<|startoftext|>", "<|endoftext|>"])}
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n")
    tok = CLIPTokenizer(str(directory / "vocab.json"), str(directory / "merges.txt"))
    eot = vocab["<|endoftext|>"]
    cfg = CLIPConfig(text_config=dict(vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, max_position_embeddings=77,
                                      bos_token_id=vocab["<|startoftext|>"], eos_token_id=eot, pad_token_id=eot),
                     vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                        image_size=32, patch_size=8), projection_dim=8)
    torch.manual_seed(0)
    CLIPModel(cfg).save_pretrained(directory)
    ip = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=ip, tokenizer=tok).save_pretrained(directory)
    return str(directory)


def test_geneval_clip_colors(tmp_path):
    pytest.importorskip("transformers")
    path = save_tiny_clip(tmp_path)
    clf = CLIPColorClassifier(path)
    w = clf.class_weights("dog")
    # fp32 normalized CLIP features (norms and means of a few hundred O(0.1) terms): reordering, ~1e-6
    assert w.shape == (len(COLORS), 8) and torch.allclose(w.norm(dim=-1), torch.ones(len(COLORS)), atol=1e-5)
    # clip_benchmark's recipe by hand for one colour: mean of the unit template embeddings, renormalised
    texts = [t.format(c="pink", cls="dog") for t in clf.TEMPLATES]
    tok = clf.processor.tokenizer(texts, padding=True, return_tensors="pt")
    f = torch.nn.functional.normalize(feature_tensor(clf.model.get_text_features(**tok)), dim=-1).mean(0)
    assert torch.allclose(w[COLORS.index("pink")], torch.nn.functional.normalize(f, dim=0), atol=1e-5)
    img = torch.rand(3, 48, 48, generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(48, 48, dtype=torch.bool)
    mask[4:20, 4:20] = True
    dets = [det("dog", (4, 4, 20, 20)), det("dog", (0, 0, 48, 48), mask=mask)]
    got = clf(img, dets, "dog")
    assert len(got) == 2 and set(got) <= set(COLORS) and clf(img, dets, "dog") == got  # deterministic
    fn = build_reward("geneval", color_classifier="clip", clip_model=path)
    rec = {"tag": "colors", "include": [{"class": "dog", "count": 1, "color": got[0]}],
           "detections": [{"class": "dog", "box": [4, 4, 20, 20]}]}
    out = fn(img[None], ["p"], [rec])
    assert out["strict"][0] == 1.0 and out["color"][0] == 1.0 and fn.info()["weights_sha256"]
    with pytest.raises(RewardConfigError, match="clip_model"):
        build_reward("geneval", color_classifier="clip")
    with pytest.raises(RewardConfigError, match="not found"):
        build_reward("geneval", color_classifier="clip", clip_model=str(tmp_path / "nowhere"))
    partial = tmp_path / "weights_only"
    partial.mkdir()
    (partial / "config.json").write_text((tmp_path / "config.json").read_text())
    with pytest.raises(RewardConfigError, match="cannot load"):  # no weights, tokenizer or image processor
        build_reward("geneval", color_classifier="clip", clip_model=str(partial))

"""CLIP-family rewards (clip_score, pickscore, aesthetic, hpsv2) on tiny random backbones in the real file layouts.

The equivalence check: the tiny open_clip model (the reference architecture of HPSv2 and of OpenAI/laion CLIP)
and its conversion to a transformers CLIPModel give the same features through our two loaders (hpsv2 on
open_clip, clip_score on transformers) and through open_clip called directly, and the two tokenizers agree.
"""

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("open_clip")

import difrl.rewards.clip  # noqa: E402,F401  (registers clip_score, pickscore, aesthetic)
import difrl.rewards.hps  # noqa: E402,F401  (registers hpsv2)
from difrl.rewards import REWARDS, RewardConfigError, build_reward  # noqa: E402
from difrl.rewards import tiny  # noqa: E402
from difrl.rewards.vision import (OPENAI_MEAN, OPENAI_STD, TextEmbeddingCache, hf_image_settings, normalize,  # noqa: E402
                                  preprocess_clip, resize_longest_pad_square)
from tolerances import FP32_REORDER  # noqa: E402

NAMES = ("clip_score", "pickscore", "aesthetic", "hpsv2")
PROMPTS = ["a photo of a cat", "A RED car,   parked on the street!!", "a photo of a cat", "über café, naïve 42",
           "it's a dog's life", "a photo of a cat"]


@pytest.fixture(scope="module")
def opts(tmp_path_factory):
    return tiny.tiny_reward_options(tmp_path_factory.mktemp("tiny_rewards"))


@pytest.fixture(scope="module")
def images():
    g = torch.Generator().manual_seed(0)
    return torch.rand(len(PROMPTS), 3, 40, 56, generator=g)


@pytest.fixture(scope="module")
def rewards(opts):
    return {n: build_reward(n, **opts[n]) for n in NAMES}


# ------------------------------------------------------------------------------------------- (a) build + score

def test_registered_by_import():
    assert REWARDS["clip_score"] is difrl.rewards.clip.ClipScore and REWARDS["pickscore"] is difrl.rewards.clip.PickScore
    assert REWARDS["aesthetic"] is difrl.rewards.clip.Aesthetic and REWARDS["hpsv2"] is difrl.rewards.hps.HPSv2


def test_every_reward_builds_and_scores(rewards, images):
    for name, r in rewards.items():
        out = r(images, PROMPTS)
        s = out[name]
        assert s.shape == (len(PROMPTS),) and s.dtype == torch.float32 and torch.isfinite(s).all(), name
        assert all(v.shape == s.shape and torch.isfinite(v).all() for v in out.values()), name
        info = r.info()
        assert info["modality"] == "image" and info["device"] == "cpu" and info["weights_sha256"], name
        assert info["version"] not in ("", "1"), name
    assert set(rewards["clip_score"](images, PROMPTS)) == {"clip_score", "cos"}
    assert set(rewards["pickscore"](images, PROMPTS)) == {"pickscore", "cos", "logit"}
    # the values themselves are checked against transformers / open_clip in tests/test_rewards_values.py


def test_device_auto_and_bfloat16(opts, rewards, images):
    r = build_reward("clip_score", **opts["clip_score"], device="auto", dtype="bfloat16")
    assert r.device.type == ("cuda" if torch.cuda.is_available() else "cpu") and r.dtype == torch.bfloat16
    low = r(images, PROMPTS)["clip_score"]
    # bf16 against fp32: bf16 keeps 8 bits (2^-8 = 0.4% relative per op) through a few layers of O(1) features
    assert torch.allclose(low, rewards["clip_score"](images, PROMPTS)["clip_score"], atol=0.05)


# ------------------------------------------------------------------------------------------- (b) equivalence

@pytest.mark.parametrize("quick_gelu", [False, True])
def test_open_clip_and_transformers_loaders_give_the_same_features(tmp_path, quick_gelu):
    import open_clip

    cfg_json, ckpt = tiny.save_tiny_open_clip(tmp_path / "oc", seed=3, quick_gelu=quick_gelu)
    model_dir, proc_dir = tiny.save_tiny_hf_clip(tmp_path / "hf", seed=3, quick_gelu=quick_gelu)
    hps = build_reward("hpsv2", checkpoint=str(ckpt), model_config=str(cfg_json))
    clip = build_reward("clip_score", model_dir=str(model_dir), processor_dir=str(proc_dir))

    # the tokenizers: same ids up to the first EOT (open_clip pads with 0, transformers with EOT; the causal
    # mask makes the pooled EOT feature independent of what follows it)
    prompts = PROMPTS + ["a very long prompt " * 30]
    oc_ids = open_clip.get_tokenizer(hps.fn.architecture)(prompts)  # [N, 77]
    hf_ids = clip.fn.tokenizer(prompts, padding="max_length", truncation=True, max_length=77,
                               return_tensors="pt")["input_ids"]
    for a, b in zip(oc_ids, hf_ids):
        n = int((a == 49407).nonzero()[0]) + 1
        assert n == int((b == 49407).nonzero()[0]) + 1 and torch.equal(a[:n], b[:n])
    assert int((oc_ids[-1] == 49407).nonzero()[0]) == 76  # truncated to 77 tokens with a final EOT

    # the reference: the open_clip architecture with the same random weights, called directly
    ref, _ = tiny.build_tiny_open_clip(seed=3, quick_gelu=quick_gelu)
    g = torch.Generator().manual_seed(1)
    x = torch.rand(len(prompts), 3, 48, 48, generator=g)  # square: HPS's pad and CLIP's crop coincide
    pixels = normalize(torch.nn.functional.interpolate(x, size=(32, 32), mode="bicubic", antialias=True),
                       OPENAI_MEAN, OPENAI_STD)
    with torch.inference_mode():
        ref_img = torch.nn.functional.normalize(ref.encode_image(pixels), dim=-1)
        ref_txt = torch.nn.functional.normalize(ref.encode_text(oc_ids), dim=-1)
        hps_img, hps_txt = hps.fn.encode_image(x), hps.fn.encode_text(prompts)
        clip_img, clip_txt = clip.fn.encode_image(x), clip.fn.encode_text(prompts)
    for ours in (hps_img, clip_img):  # the same weights through two implementations: fp32 reordering of unit vectors
        assert torch.allclose(ours, ref_img, atol=1e-5), (ours - ref_img).abs().max()
    for ours in (hps_txt, clip_txt):
        assert torch.allclose(ours, ref_txt, atol=1e-5), (ours - ref_txt).abs().max()
    cos_hps, cos_clip = hps(x, prompts)["hpsv2"], clip(x, prompts)["clip_score"]
    assert torch.allclose(cos_hps, cos_clip, atol=1e-5) and torch.allclose(cos_hps, (ref_img * ref_txt).sum(-1), atol=1e-5)
    # not trivially equal: the features vary across images and prompts, and the wrong activation is visible
    assert cos_hps.std() > 1e-3
    wrong_cfg = {**tiny.tiny_open_clip_config(quick_gelu=not quick_gelu)}
    wrong = tiny.open_clip_to_hf(ref, wrong_cfg)  # same weights, the other activation
    with torch.inference_mode():
        wrong_img = torch.nn.functional.normalize(wrong.get_image_features(pixel_values=pixels).pooler_output, dim=-1)
    assert (wrong_img - ref_img).abs().max() > 1e-4


def test_preprocessing_matches_transformers_and_pil():
    """Our tensor preprocessing is transformers 5's CLIPImageProcessor (torchvision backend) on float input, and
    close to the PIL pipelines the reference scorers use."""
    import numpy as np
    from PIL import Image
    from transformers import CLIPImageProcessor

    g = torch.Generator().manual_seed(0)
    x = torch.nn.functional.interpolate(torch.rand(2, 3, 12, 16, generator=g), size=(96, 128), mode="bilinear")
    x = (x * 255).round() / 255  # exactly representable as uint8 for the PIL comparison
    proc = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    settings = hf_image_settings(proc)
    assert settings == {"size": 32, "resample": "bicubic", "crop": (32, 32), "mean": tuple(OPENAI_MEAN),
                        "std": tuple(OPENAI_STD)}
    ours = preprocess_clip(x, settings)
    theirs = proc(images=list(x), do_rescale=False, return_tensors="pt")["pixel_values"]
    # torch's resize against the processor's numpy one, in fp32: a few ulp of normalized pixels O(1)
    assert ours.shape == theirs.shape == (2, 3, 32, 32) and torch.allclose(ours, theirs, atol=1e-5)

    # HPS: longest side to 32 (96x128 -> 24x32), zero pad 4 rows above and below; vs PIL bicubic on uint8
    hps = resize_longest_pad_square(x, 32)
    assert hps.shape == (2, 3, 32, 32) and (hps[:, :, :4] == 0).all() and (hps[:, :, 28:] == 0).all()
    pil = []
    for xi in x:
        img = Image.fromarray((xi.permute(1, 2, 0) * 255).round().byte().numpy()).resize((32, 24), Image.BICUBIC)
        pil.append(torch.nn.functional.pad(torch.from_numpy(np.array(img)).permute(2, 0, 1) / 255.0, (0, 0, 4, 4)))
    diff = (hps - torch.stack(pil)).abs()
    assert diff.mean() < 3e-3 and diff.max() < 2e-2  # the documented "slightly different" resize


# ------------------------------------------------------------------------------------------- (c) errors

def _raises(match_all, fn, *args, **kwargs):
    with pytest.raises(RewardConfigError) as e:
        fn(*args, **kwargs)
    msg = str(e.value)
    for m in match_all:
        assert str(m) in msg, (m, msg)
    return msg


def test_missing_paths_name_the_option_and_path(opts, tmp_path):
    gone = tmp_path / "nowhere"
    _raises(["clip_score", "model_dir", str(gone)], build_reward, "clip_score", model_dir=str(gone))
    _raises(["clip_score", "model_dir", "never downloads"], build_reward, "clip_score")
    _raises(["clip_score", "config.json", str(tmp_path)], build_reward, "clip_score", model_dir=str(tmp_path))
    _raises(["pickscore", "processor_dir", str(gone)], build_reward, "pickscore",
            model_dir=opts["pickscore"]["model_dir"], processor_dir=str(gone))
    # PickScore's model directory holds no processor: say where it comes from
    _raises(["pickscore", "model_dir", "preprocessor_config.json", "laion/CLIP-ViT-H-14"], build_reward,
            "pickscore", model_dir=opts["pickscore"]["model_dir"])
    no_tok = tmp_path / "proc_no_tok"
    no_tok.mkdir()
    (no_tok / "preprocessor_config.json").write_text("{}")
    _raises(["pickscore", "processor_dir", str(no_tok), "tokenizer", "laion"], build_reward, "pickscore",
            model_dir=opts["pickscore"]["model_dir"], processor_dir=str(no_tok))
    _raises(["aesthetic", "mlp_path", str(gone / "m.pth")], build_reward, "aesthetic",
            clip_dir=opts["aesthetic"]["clip_dir"], mlp_path=str(gone / "m.pth"))
    _raises(["aesthetic", "clip_dir"], build_reward, "aesthetic", mlp_path=opts["aesthetic"]["mlp_path"])
    _raises(["hpsv2", "checkpoint", str(gone / "HPS_v2.1_compressed.pt")], build_reward, "hpsv2",
            checkpoint=str(gone / "HPS_v2.1_compressed.pt"))
    _raises(["hpsv2", "model_config", str(gone / "cfg.json")], build_reward, "hpsv2",
            checkpoint=opts["hpsv2"]["checkpoint"], model_config=str(gone / "cfg.json"))


def test_wrong_files_are_named(opts, tmp_path):
    # aesthetic MLP with the wrong key layout
    bad = tmp_path / "bad_mlp.pth"
    torch.save({"fc1.weight": torch.zeros(4, 16), "fc1.bias": torch.zeros(4)}, bad)
    _raises(["aesthetic", "mlp_path", str(bad), "layers.0.weight", "fc1.weight"], build_reward, "aesthetic",
            **{**opts["aesthetic"], "mlp_path": str(bad)})
    # right layout, wrong input width for this CLIP
    wide = tiny.save_tiny_aesthetic(tmp_path / "wide", in_dim=24)
    _raises(["aesthetic", "mlp_path", str(wide), "24-d", "16-d"], build_reward, "aesthetic",
            **{**opts["aesthetic"], "mlp_path": str(wide)})
    # a wrapped and DDP-prefixed MLP file loads
    sd = torch.load(opts["aesthetic"]["mlp_path"], weights_only=True)
    wrapped = tmp_path / "wrapped.pth"
    torch.save({"state_dict": {f"module.{k}": v for k, v in sd.items()}}, wrapped)
    build_reward("aesthetic", **{**opts["aesthetic"], "mlp_path": str(wrapped)})

    # HPS checkpoint with a missing key, one with a wrong shape, one that is not a state dict
    full = torch.load(opts["hpsv2"]["checkpoint"], weights_only=True)["state_dict"]
    cfg = opts["hpsv2"]["model_config"]
    missing = tmp_path / "missing.pt"
    torch.save({"state_dict": {k: v for k, v in full.items() if k != "ln_final.weight"}}, missing)
    _raises(["hpsv2", "checkpoint", str(missing), "ln_final.weight"], build_reward, "hpsv2",
            checkpoint=str(missing), model_config=cfg)
    shape = tmp_path / "shape.pt"
    torch.save({**full, "ln_final.weight": torch.ones(3)}, shape)  # a bare state dict is accepted as a layout
    _raises(["hpsv2", "checkpoint", str(shape), "shapes"], build_reward, "hpsv2", checkpoint=str(shape), model_config=cfg)
    junk = tmp_path / "junk.pt"
    torch.save([1, 2, 3], junk)
    _raises(["hpsv2", "checkpoint", str(junk)], build_reward, "hpsv2", checkpoint=str(junk), model_config=cfg)
    bare = tmp_path / "bare.pt"
    torch.save(full, bare)
    build_reward("hpsv2", checkpoint=str(bare), model_config=cfg)
    # a config whose name open_clip already knows with other contents (registration is process-wide)
    clash = tmp_path / "clash" / Path(cfg).name
    clash.parent.mkdir()
    clash.write_text(json.dumps({**json.loads(Path(cfg).read_text()), "embed_dim": 8}))
    _raises(["hpsv2", "model_config", str(clash), "different config"], build_reward, "hpsv2", checkpoint=str(bare),
            model_config=str(clash))
    # an unknown architecture and a bad option value
    _raises(["hpsv2", "architecture", "ViT-Nope"], build_reward, "hpsv2", checkpoint=str(bare), architecture="ViT-Nope")
    for variant in ("v3", "v2.1"):  # v2.1 too: it only ever changed the version label, the checkpoint decides
        _raises(["hpsv2", "variant", "only in their weights"], build_reward, "hpsv2", checkpoint=str(bare),
                model_config=cfg, variant=variant)
    _raises(["clip_score", "scale"], build_reward, "clip_score", **opts["clip_score"], scale="x1000")
    _raises(["pickscore", "scale"], build_reward, "pickscore", **opts["pickscore"], scale="div100")


# ------------------------------------------------------------------------------------------- (d) conventions

def test_scaling_conventions(opts, rewards, images):
    cos = rewards["clip_score"](images, PROMPTS)["cos"]
    # default "cos" (the same call: exact)
    assert torch.equal(rewards["clip_score"](images, PROMPTS)["clip_score"], cos)
    for scale, k in (("clipscore", 2.5), ("x100", 100.0)):
        r = build_reward("clip_score", **opts["clip_score"], scale=scale)
        out = r(images, PROMPTS)
        # another reward object with the same weights: fp32 reordering at most; k x cos rounds once more
        assert torch.allclose(out["cos"], cos, **FP32_REORDER)
        assert torch.allclose(out["clip_score"], k * cos.clamp(min=0), atol=1e-6)
        # max(cos, 0) on both sides of 0, whatever signs the random model gives
        r.fn.cosine = lambda images, prompts: torch.tensor([-0.5, 0.0, 0.2])
        assert torch.allclose(r(images[:3], PROMPTS[:3])["clip_score"], torch.tensor([0.0, 0.0, 0.2 * k]),
                              **FP32_REORDER)

    div = rewards["pickscore"](images, PROMPTS)
    logit = build_reward("pickscore", **opts["pickscore"], scale="logit")(images, PROMPTS)
    scale = rewards["pickscore"].fn.model.logit_scale.exp()
    # fp32: scale ~ 100 x cos, ulp(100) ~ 8e-6
    assert torch.allclose(logit["pickscore"], scale * logit["cos"], atol=1e-5)
    assert torch.allclose(div["pickscore"], logit["pickscore"] / 26, atol=1e-6)  # the same logits / 26: fp32 ulps
    assert rewards["pickscore"].info()["version"] != build_reward("pickscore", **opts["pickscore"], scale="logit").info()["version"]


# ------------------------------------------------------------------------------------------- (e) cache, (f) chunks

@pytest.mark.parametrize("name", ["clip_score", "hpsv2"])
def test_text_cache_same_scores_and_encodes_each_prompt_once(opts, images, name):
    cached = build_reward(name, **opts[name])
    plain = build_reward(name, **opts[name], text_cache_size=0)
    calls = []
    enc = cached.fn.text_cache.encode
    cached.fn.text_cache.encode = lambda ps: calls.append(list(ps)) or enc(ps)
    a, b = cached(images, PROMPTS)[name], plain(images, PROMPTS)[name]
    assert torch.allclose(a, b, atol=1e-6)  # cached text features came from another batch of prompts: fp32 reordering
    assert calls == [list(dict.fromkeys(PROMPTS))] and len(cached.fn.text_cache) == len(set(PROMPTS))
    again = cached(images.flip(0), PROMPTS[::-1])[name]
    assert len(calls) == 1 and torch.allclose(again, a.flip(0), atol=1e-6)  # images in another order: as above
    assert len(plain.fn.text_cache) == 0


def test_text_cache_is_bounded_and_differentiable():
    cache = TextEmbeddingCache(lambda ps: torch.nn.functional.normalize(torch.randn(len(ps), 4), dim=-1), max_size=2)
    with torch.inference_mode():
        cache(["a", "b", "c"])
    assert len(cache) == 2
    img = torch.randn(2, 4, requires_grad=True)
    (img * cache(["b", "c"])).sum().backward()  # embeddings made under inference mode, used with autograd
    assert img.grad is not None


def test_batch_size_chunking_gives_the_same_scores(opts, rewards, images):
    assert build_reward("hpsv2", **opts["hpsv2"], batch_size=4).batch_size == 4  # the option reaches the wrapper
    for name, r in rewards.items():
        one = r(images, PROMPTS)  # batch_size 32: one chunk of 6
        r.batch_size = 4  # 6 = 4 + 2 (Reward reads batch_size at each call)
        try:
            chunked = r(images, PROMPTS)
        finally:
            r.batch_size = 32
        for k in one:
            assert torch.allclose(one[k], chunked[k], atol=1e-5), (name, k)  # batches of 4 + 2 vs 6: fp32 reordering

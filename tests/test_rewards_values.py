"""The CLIP-family rewards' values against independent computations, on fixtures in the released files' layouts.

    HF_HUB_OFFLINE=1 python -m pytest tests/test_rewards_values.py -q

The fixtures are written here, key by key, in the layouts of the files users download, not by difrl's
tiny.py: an `openai/clip-vit-large-patch14` / `yuvalkirstain/PickScore_v1` style transformers directory
(config.json with the released fields, model.safetensors with the released key names, the `position_ids`
buffers older transformers saved, an old-style preprocessor_config.json with int sizes), the LAION
`sac+logos+ava1-l14-linearMSE.pth` MLP (a bare state dict, layers.0/2/4/6/7, 768-d input) and
`HPS_v2.1_compressed.pt` ({"state_dict": ...} with open_clip's key names). So a loader that expected
another layout fails here. The expected values are computed in each test with transformers / open_clip /
plain tensor calls, not through difrl's preprocessing or scoring code.
"""

from __future__ import annotations

import json
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("open_clip")
from safetensors.torch import save_file  # noqa: E402

import difrl.rewards.clip  # noqa: E402,F401
import difrl.rewards.hps  # noqa: E402,F401
from difrl.rewards import RewardConfigError, build_reward  # noqa: E402
from difrl.rewards.tiny import save_clip_tokenizer  # noqa: E402  (the real CLIP BPE files; not a weights layout)

MEAN = [0.48145466, 0.4578275, 0.40821073]  # openai/clip-vit-large-patch14 preprocessor_config.json
STD = [0.26862954, 0.26130258, 0.27577711]
PROMPTS = ["a photo of a cat", "a red car parked on the street", "a photo of a cat", "a bowl of soup"]
# Each reward against its reference implementation (transformers / open_clip / the LAION MLP) with the same weights:
# fp32 in another op order, so atol 1e-6 on cosines, 1e-5 on O(1) scores and 1e-4 on logits (100 x a cosine)
TEXT = dict(width=16, layers=2, heads=2, ctx=77, vocab=49408)
VISION = dict(width=32, layers=2, heads=2, image=32, patch=8)


def _rand(g, *shape, scale=0.2):
    return torch.randn(*shape, generator=g) * scale


def _ln(g, n):  # a layer norm that is not the identity
    return 1.0 + _rand(g, n, scale=0.1), _rand(g, n, scale=0.1)


# --------------------------------------------------------------------------- released layouts, written by hand

def hf_clip_layout(projection_dim: int, seed: int, logit_scale: float) -> dict[str, torch.Tensor]:
    """The keys of a transformers CLIPModel checkpoint as openai/clip-vit-large-patch14 and PickScore_v1 ship
    them (model.safetensors), at tiny sizes."""
    g = torch.Generator().manual_seed(seed)
    sd = {"logit_scale": torch.tensor(logit_scale)}
    for tower, w, layers in (("text_model", TEXT["width"], TEXT["layers"]), ("vision_model", VISION["width"], VISION["layers"])):
        for i in range(layers):
            p = f"{tower}.encoder.layers.{i}."
            for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
                sd[p + f"self_attn.{proj}.weight"], sd[p + f"self_attn.{proj}.bias"] = _rand(g, w, w), _rand(g, w, scale=0.05)
            sd[p + "layer_norm1.weight"], sd[p + "layer_norm1.bias"] = _ln(g, w)
            sd[p + "layer_norm2.weight"], sd[p + "layer_norm2.bias"] = _ln(g, w)
            sd[p + "mlp.fc1.weight"], sd[p + "mlp.fc1.bias"] = _rand(g, 4 * w, w), _rand(g, 4 * w, scale=0.05)
            sd[p + "mlp.fc2.weight"], sd[p + "mlp.fc2.bias"] = _rand(g, w, 4 * w), _rand(g, w, scale=0.05)
    tw, vw = TEXT["width"], VISION["width"]
    n_patches = (VISION["image"] // VISION["patch"]) ** 2
    sd["text_model.embeddings.token_embedding.weight"] = _rand(g, TEXT["vocab"], tw)
    sd["text_model.embeddings.position_embedding.weight"] = _rand(g, TEXT["ctx"], tw)
    sd["text_model.embeddings.position_ids"] = torch.arange(TEXT["ctx"]).unsqueeze(0)  # saved by older transformers
    sd["text_model.final_layer_norm.weight"], sd["text_model.final_layer_norm.bias"] = _ln(g, tw)
    sd["vision_model.embeddings.class_embedding"] = _rand(g, vw)
    sd["vision_model.embeddings.patch_embedding.weight"] = _rand(g, vw, 3, VISION["patch"], VISION["patch"])
    sd["vision_model.embeddings.position_embedding.weight"] = _rand(g, n_patches + 1, vw)
    sd["vision_model.embeddings.position_ids"] = torch.arange(n_patches + 1).unsqueeze(0)
    sd["vision_model.pre_layrnorm.weight"], sd["vision_model.pre_layrnorm.bias"] = _ln(g, vw)  # sic, as released
    sd["vision_model.post_layernorm.weight"], sd["vision_model.post_layernorm.bias"] = _ln(g, vw)
    sd["visual_projection.weight"] = _rand(g, projection_dim, vw)
    sd["text_projection.weight"] = _rand(g, projection_dim, tw)
    return sd


def write_hf_clip(d, projection_dim=16, seed=0, logit_scale=math.log(100.0), resample=3, prefix=""):
    """A save_pretrained-style CLIP directory (config + weights + processor + tokenizer) in the released layout."""
    d.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["CLIPModel"], "model_type": "clip", "projection_dim": projection_dim,
           "logit_scale_init_value": 2.6592,
           "text_config": {"model_type": "clip_text_model", "vocab_size": TEXT["vocab"], "hidden_size": TEXT["width"],
                           "intermediate_size": 4 * TEXT["width"], "num_hidden_layers": TEXT["layers"],
                           "num_attention_heads": TEXT["heads"], "max_position_embeddings": TEXT["ctx"],
                           "hidden_act": "quick_gelu", "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1,
                           "projection_dim": projection_dim},
           "vision_config": {"model_type": "clip_vision_model", "hidden_size": VISION["width"],
                             "intermediate_size": 4 * VISION["width"], "num_hidden_layers": VISION["layers"],
                             "num_attention_heads": VISION["heads"], "image_size": VISION["image"],
                             "patch_size": VISION["patch"], "hidden_act": "quick_gelu", "projection_dim": projection_dim}}
    (d / "config.json").write_text(json.dumps(cfg))
    sd = {prefix + k: v.contiguous() for k, v in hf_clip_layout(projection_dim, seed, logit_scale).items()}
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    save_clip_tokenizer(d)
    (d / "preprocessor_config.json").write_text(json.dumps(
        {"crop_size": VISION["image"], "do_center_crop": True, "do_normalize": True, "do_resize": True,
         "feature_extractor_type": "CLIPFeatureExtractor", "image_mean": MEAN, "image_std": STD,
         "resample": resample, "size": VISION["image"]}))
    return d


def laion_mlp_layout(in_dim=768, seed=0) -> dict[str, torch.Tensor]:
    """sac+logos+ava1-l14-linearMSE.pth: a bare state dict of nn.Sequential indices 0, 2, 4, 6, 7
    (Linear in->1024, Dropout, 1024->128, Dropout, 128->64, Dropout, 64->16, 16->1)."""
    g = torch.Generator().manual_seed(seed)
    dims = [(0, in_dim, 1024), (2, 1024, 128), (4, 128, 64), (6, 64, 16), (7, 16, 1)]
    sd = {}
    for i, fan_in, fan_out in dims:
        sd[f"layers.{i}.weight"] = _rand(g, fan_out, fan_in, scale=1.0 / math.sqrt(fan_in))
        sd[f"layers.{i}.bias"] = _rand(g, fan_out, scale=0.1)
    return sd


def hps_layout(cfg: dict, seed=0, vision_layers=None, text_layers=None) -> dict[str, torch.Tensor]:
    """The state dict inside HPS_v2(.1)_compressed.pt: open_clip's CLIP keys (OpenAI's names), no attn_mask."""
    g = torch.Generator().manual_seed(seed)
    v, t, e = cfg["vision_cfg"], cfg["text_cfg"], cfg["embed_dim"]
    vl, tl = vision_layers or v["layers"], text_layers or t["layers"]
    sd = {}

    def blocks(prefix, w, n):
        for i in range(n):
            p = f"{prefix}transformer.resblocks.{i}."
            sd[p + "ln_1.weight"], sd[p + "ln_1.bias"] = _ln(g, w)
            sd[p + "attn.in_proj_weight"], sd[p + "attn.in_proj_bias"] = _rand(g, 3 * w, w), _rand(g, 3 * w, scale=0.05)
            sd[p + "attn.out_proj.weight"], sd[p + "attn.out_proj.bias"] = _rand(g, w, w), _rand(g, w, scale=0.05)
            sd[p + "ln_2.weight"], sd[p + "ln_2.bias"] = _ln(g, w)
            sd[p + "mlp.c_fc.weight"], sd[p + "mlp.c_fc.bias"] = _rand(g, 4 * w, w), _rand(g, 4 * w, scale=0.05)
            sd[p + "mlp.c_proj.weight"], sd[p + "mlp.c_proj.bias"] = _rand(g, w, 4 * w), _rand(g, w, scale=0.05)

    vw, tw = v["width"], t["width"]
    grid = (v["image_size"] // v["patch_size"]) ** 2
    sd["visual.class_embedding"] = _rand(g, vw)
    sd["visual.positional_embedding"] = _rand(g, grid + 1, vw)
    sd["visual.proj"] = _rand(g, vw, e)
    sd["visual.conv1.weight"] = _rand(g, vw, 3, v["patch_size"], v["patch_size"])
    sd["visual.ln_pre.weight"], sd["visual.ln_pre.bias"] = _ln(g, vw)
    blocks("visual.", vw, vl)
    sd["visual.ln_post.weight"], sd["visual.ln_post.bias"] = _ln(g, vw)
    sd["positional_embedding"] = _rand(g, t["context_length"], tw)
    sd["text_projection"] = _rand(g, tw, e)
    sd["logit_scale"] = torch.tensor(math.log(1 / 0.07))
    sd["token_embedding.weight"] = _rand(g, t["vocab_size"], tw)
    sd["ln_final.weight"], sd["ln_final.bias"] = _ln(g, tw)
    blocks("", tw, tl)
    return sd


HPS_CFG = {"embed_dim": 16,
           "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "head_width": 16, "patch_size": 8},
           "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 16, "heads": 2, "layers": 2}}


# --------------------------------------------------------------------------- independent computations

def _images(n=len(PROMPTS), h=40, w=56, seed=0):
    return torch.rand(n, 3, h, w, generator=torch.Generator().manual_seed(seed))


def hf_reference(d, images, prompts):
    """(cos [B], logits_per_image diagonal [B], normalised image embeddings [B, D]) with transformers' own
    CLIPModel + CLIPProcessor (torchvision backend, float input: do_rescale=False)."""
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(str(d), local_files_only=True).eval()
    proc = CLIPProcessor.from_pretrained(str(d), local_files_only=True)
    batch = proc(text=prompts, images=list(images), do_rescale=False, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model(**batch)
    img = F.normalize(out.image_embeds, dim=-1)
    txt = F.normalize(out.text_embeds, dim=-1)
    return (img * txt).sum(-1), out.logits_per_image.diagonal(), img


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return write_hf_clip(tmp_path_factory.mktemp("clip") / "clip-vit-large-patch14")


# --------------------------------------------------------------------------- clip_score / pickscore

def test_clip_score_scales_equal_transformers(clip_dir):
    images = _images()
    cos, logits, _ = hf_reference(clip_dir, images, PROMPTS)
    assert cos.std() > 1e-3 and torch.allclose(logits, 100 * cos, atol=1e-4)  # exp(logit_scale) = 100, as OpenAI's
    want = {"cos": cos, "flow_grpo": logits / 30, "clipscore": 2.5 * cos.clamp(min=0), "x100": 100 * cos.clamp(min=0)}
    for scale, ref in want.items():
        got = build_reward("clip_score", model_dir=str(clip_dir), scale=scale)(images, PROMPTS)
        assert torch.allclose(got["clip_score"], ref, atol=1e-5), (scale, got["clip_score"], ref)
        assert torch.allclose(got["cos"], cos, atol=1e-6)
    # flow_grpo's scale is about 3.33 x the cosine, so it is not the "cos" convention
    flow = build_reward("clip_score", model_dir=str(clip_dir), scale="flow_grpo")
    assert flow.info()["version"] == "exp(logit_scale)*cos/30"


def test_pickscore_equals_transformers_and_bf16_keeps_the_fp32_scale(clip_dir):
    images = _images()
    cos, logits, _ = hf_reference(clip_dir, images, PROMPTS)
    fp32 = build_reward("pickscore", model_dir=str(clip_dir), processor_dir=str(clip_dir))(images, PROMPTS)
    assert torch.allclose(fp32["pickscore"], logits / 26, atol=1e-5) and torch.allclose(fp32["logit"], logits, atol=1e-4)

    bf16 = build_reward("pickscore", model_dir=str(clip_dir), processor_dir=str(clip_dir), dtype="bfloat16")
    assert bf16.fn.model.logit_scale.dtype == torch.bfloat16  # the model itself is in bf16 ...
    low = bf16(images, PROMPTS)
    # ... but the scale is the checkpoint's exp(ln 100) = 100 in float32, not exp(bf16(ln 100)) = 98.86
    scale = torch.tensor(math.log(100.0)).exp()
    assert torch.allclose(low["logit"], scale * low["cos"], rtol=1e-6, atol=0), (low["logit"] / low["cos"])
    # bf16 changes the score only through the cosine
    assert torch.allclose(low["pickscore"] - fp32["pickscore"], (low["cos"] - fp32["cos"]) * scale / 26, atol=1e-5)


@pytest.mark.parametrize("resample", [2, 0])  # PIL BILINEAR, NEAREST (CLIP processors' default is 3, BICUBIC)
def test_processor_resample_is_honoured(tmp_path, resample):
    d = write_hf_clip(tmp_path / f"pick{resample}", resample=resample)
    images = _images()
    cos, logits, _ = hf_reference(d, images, PROMPTS)
    r = build_reward("pickscore", model_dir=str(d), processor_dir=str(d))
    assert torch.allclose(r(images, PROMPTS)["pickscore"], logits / 26, atol=1e-5)
    # the bicubic default would score these images differently
    bicubic = write_hf_clip(tmp_path / "pick3", resample=3)
    other = build_reward("pickscore", model_dir=str(bicubic), processor_dir=str(bicubic))(images, PROMPTS)["pickscore"]
    assert (other - logits / 26).abs().max() > 1e-3


def test_unsupported_resample_is_a_config_error(tmp_path):
    d = write_hf_clip(tmp_path / "lanczos", resample=1)
    with pytest.raises(RewardConfigError, match=r"pickscore.*processor_dir.*resample 1"):
        build_reward("pickscore", model_dir=str(d), processor_dir=str(d))


def test_weights_in_another_layout_are_refused(tmp_path):
    """transformers would initialise every parameter at random (with a warning) for a file of other key names."""
    d = write_hf_clip(tmp_path / "prefixed", prefix="net.")  # ("clip." is CLIPModel's own prefix, stripped)
    with pytest.raises(RewardConfigError, match=r"clip_score.*model_dir.*missing keys.*unexpected keys"):
        build_reward("clip_score", model_dir=str(d))
    sd = hf_clip_layout(16, 0, 1.0)
    del sd["visual_projection.weight"]
    d2 = write_hf_clip(tmp_path / "short")
    save_file({k: v.contiguous() for k, v in sd.items()}, str(d2 / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(RewardConfigError, match=r"1 missing keys \['visual_projection.weight'\]"):
        build_reward("clip_score", model_dir=str(d2))


# --------------------------------------------------------------------------- aesthetic

def test_aesthetic_equals_the_laion_recipe(tmp_path):
    clip = write_hf_clip(tmp_path / "clip-vit-large-patch14", projection_dim=768)
    mlp_path = tmp_path / "sac+logos+ava1-l14-linearMSE.pth"
    mlp = laion_mlp_layout(768)
    torch.save(mlp, mlp_path)  # the released file is a torch.save of the bare state dict
    images = _images()
    r = build_reward("aesthetic", clip_dir=str(clip), mlp_path=str(mlp_path))
    got = r(images, PROMPTS)["aesthetic"]

    _, _, emb = hf_reference(clip, images, PROMPTS)  # L2-normalised image embeddings [B, 768]

    def laion_mlp(x):  # eval mode: the dropouts are the identity, and there are no activations
        for i in (0, 2, 4, 6, 7):
            x = x @ mlp[f"layers.{i}.weight"].T + mlp[f"layers.{i}.bias"]
        return x.squeeze(-1)

    want = laion_mlp(emb)
    assert got.std() > 1e-4 and torch.allclose(got, want, atol=1e-5), (got, want)
    # the normalisation matters: the same MLP on the raw embedding gives other numbers
    from transformers import CLIPModel, CLIPProcessor

    raw = CLIPModel.from_pretrained(str(clip)).get_image_features(
        **CLIPProcessor.from_pretrained(str(clip))(images=list(images), do_rescale=False, return_tensors="pt"))
    raw = raw.pooler_output if hasattr(raw, "pooler_output") else raw
    assert (laion_mlp(raw.detach()) - want).abs().max() > 1e-3


# --------------------------------------------------------------------------- hpsv2

def _hps_files(tmp_path, seed=0):
    cfg_path = tmp_path / "difrl-test-hps-layout.json"
    cfg_path.write_text(json.dumps(HPS_CFG))
    sd = hps_layout(HPS_CFG, seed)
    ckpt = tmp_path / "HPS_v2.1_compressed.pt"
    torch.save({"state_dict": sd}, ckpt)
    return cfg_path, ckpt, sd


def test_hps_layout_has_the_released_key_count():
    """The hand-written layout at ViT-H-14's depths has the 686 keys of HPS_v2.1
    (docs/reference/specs/rewards-eval.md §0.1)."""
    h14 = {"embed_dim": 4, "vision_cfg": {"image_size": 14, "layers": 32, "width": 4, "patch_size": 14},
           "text_cfg": {"context_length": 2, "vocab_size": 2, "width": 4, "layers": 24}}
    assert len(hps_layout(h14)) == 686


def _open_clip_reference(sd, pixels, prompts):
    import open_clip

    model = open_clip.CLIP(**HPS_CFG).eval()
    model.load_state_dict(sd, strict=True)
    tok = open_clip.tokenize(prompts)
    with torch.no_grad():
        img = F.normalize(model.encode_image(pixels), dim=-1)
        txt = F.normalize(model.encode_text(tok), dim=-1)
    return (img * txt).sum(-1)


def _normalise(x):
    return (x - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)


def test_hpsv2_equals_open_clip_with_the_hps_resize_and_pad(tmp_path):
    cfg_path, ckpt, sd = _hps_files(tmp_path)
    r = build_reward("hpsv2", checkpoint=str(ckpt), model_config=str(cfg_path))
    # 40 x 56: the longer side to 32 -> 23 x 32 (round(40 * 32 / 56) = 23), 9 rows of zeros: 4 above, 5 below
    images = _images(h=40, w=56)
    resized = F.interpolate(images, size=(23, 32), mode="bicubic", antialias=True, align_corners=False)
    padded = torch.cat([torch.zeros(4, 3, 4, 32), resized, torch.zeros(4, 3, 5, 32)], dim=2)
    want = _open_clip_reference(sd, _normalise(padded), PROMPTS)
    got = r(images, PROMPTS)["hpsv2"]
    assert want.std() > 1e-3 and torch.allclose(got, want, atol=1e-5), (got, want)


def test_hpsv2_at_exactly_the_model_size(tmp_path):
    """HPSv2's ResizeMaxSize resizes and pads only when the scale is not 1: a square image at the model's size
    goes in untouched; a non-square one whose longer side is that size would go in unpadded, which the model
    cannot take, so it is an error naming the shape (never a padded image's score)."""
    cfg_path, ckpt, sd = _hps_files(tmp_path)
    r = build_reward("hpsv2", checkpoint=str(ckpt), model_config=str(cfg_path))
    square = _images(h=32, w=32)
    assert torch.equal(r.fn.preprocess(square), _normalise(square))
    assert torch.allclose(r(square, PROMPTS)["hpsv2"], _open_clip_reference(sd, _normalise(square), PROMPTS), atol=1e-5)
    with pytest.raises(ValueError, match="32x24 image"):
        r(_images(h=32, w=24), PROMPTS)

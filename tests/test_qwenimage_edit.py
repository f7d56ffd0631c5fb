"""Qwen-Image-Edit (kind qwenimage_edit): what the parametrised family tests do not cover.

    HF_HUB_OFFLINE=1 python -m pytest tests/test_qwenimage_edit.py -q

tests/test_diffusers_models.py and tests/test_train_diffusers.py run the family checks on it (ODE rollout == the
pipeline's own call with the same source images, guidance off and on; SDE ratio 1; LoRA round trip; two training
iterations; the tiny config learns). Here: ImagePrompt (text + source image) as a prompt and a cache key; the tiny
tokenizer's edit template drops exactly the system part; the source size is the pipeline's calculate_dimensions; the
negative prompt is read with each row's own source; refusals (a plain prompt, another aspect ratio, an unreadable image);
the edit world reading {"prompt", "image"} records and its config errors.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from difrl.models.adapters import build_tiny_pipeline, make_tiny_pipeline  # noqa: E402
from difrl.models.diffusers_base import ImagePrompt  # noqa: E402
from difrl.models.qwenimage_edit import QwenImageEditPolicy  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EDIT_SET = ROOT / "difrl" / "assets" / "edit_tiny"
SQUARE, CIRCLE = EDIT_SET / "square.png", EDIT_SET / "circle.png"


@pytest.fixture(scope="module")
def pipe():
    return build_tiny_pipeline("qwenimage_edit")


def policy_of(pipe, **options) -> QwenImageEditPolicy:
    return QwenImageEditPolicy(pipe, **{"height": 32, "width": 32, "max_sequence_length": 16, "source_size": 32,
                                        **options})


def test_an_image_prompt_is_its_text_carrying_its_image():
    a, b = ImagePrompt("make it red", SQUARE), ImagePrompt("make it red", CIRCLE)
    assert isinstance(a, str) and str(a) == "make it red" and a.image == str(SQUARE)
    assert a != b and a != "make it red" and "make it red" != a  # one instruction on two images: two prompts
    assert a == ImagePrompt("make it red", str(SQUARE)) and len({a, b, ImagePrompt("make it red", SQUARE)}) == 2
    again = pickle.loads(pickle.dumps(a))
    assert again == a and again.image == a.image
    assert json.dumps([a]) == '["make it red"]'  # logs and reward metadata see the text


def test_the_tiny_edit_template_drops_exactly_its_system_part(pipe):
    # the pipeline drops prompt_template_encode_start_idx = 64 leading hidden states: the real tokenizer's system part;
    # the tiny one's is 64 tokens too, so what is kept starts at the image's <|vision_start|>
    from PIL import Image

    image = pipe.image_processor.resize(Image.open(SQUARE).convert("RGB"), 32, 32)
    inputs = pipe.processor(text=[pipe.prompt_template_encode.format("make it red")], images=[image], return_tensors="pt")
    tokens = pipe.tokenizer.convert_ids_to_tokens(inputs["input_ids"][0])
    drop = pipe.prompt_template_encode_start_idx
    assert drop == 64 and tokens[drop - 1] == "Ċ" and tokens[drop] == "<|vision_start|>"
    cond = policy_of(pipe).encode([ImagePrompt("make it red", SQUARE)])
    # kept: vision start + 4 image tokens + vision end, the instruction, the template's 5 end tokens
    assert int(cond["prompt_embeds_mask"].sum()) == len(tokens) - drop
    assert cond["prompt_embeds"].shape[1] == 6 + 16 + 5 and cond["image_latents"].shape == (1, 16, 16)


def test_the_source_size_is_the_pipelines_calculate_dimensions(pipe):
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    policy = QwenImageEditPolicy(pipe, height=32, width=32)  # the default: the pipeline's 1024^2 area
    for w, h in ((800, 600), (512, 512), (300, 900)):
        cw, ch, _ = calculate_dimensions(1024 * 1024, w / h)
        assert policy.source_hw((w, h)) == (ch, cw)
    assert policy_of(pipe, source_size=384).source_hw((800, 600)) == (320, 448)  # area ~384^2, sides of 32


def test_the_negative_prompt_is_read_with_each_rows_own_source(pipe):
    policy = policy_of(pipe, cache_prompts=True)
    rows = [ImagePrompt("make it red", SQUARE), ImagePrompt("make it red", CIRCLE)]
    cond = policy.encode(rows)
    assert len(policy._cache) == 2  # the same instruction on two images: two cache entries
    assert not torch.equal(cond["prompt_embeds"][0], cond["prompt_embeds"][1])  # the images differ in the embeddings
    neg = cond["negative_prompt_embeds"]
    assert not torch.equal(neg[0], neg[1])  # "" with each row's image, as the pipeline encodes its negative
    alone = policy_of(pipe).encode([rows[1]])["negative_prompt_embeds"]
    assert (alone[0] - neg[1]).abs().max() < 1e-5  # fp32: a row's embedding does not depend on its batch
    uncond = policy.uncond(cond, 2)
    assert uncond["prompt_embeds"] is neg and uncond["image_latents"] is cond["image_latents"]


def test_plain_prompts_other_aspect_ratios_and_unreadable_images_are_refused(pipe, tmp_path):
    from PIL import Image

    policy = policy_of(pipe)
    with pytest.raises(ValueError, match=r"each prompt must be an ImagePrompt.*got the plain prompt 'a red dog'"):
        policy.encode(["a red dog"])
    policy.encode([ImagePrompt("make it red", SQUARE)])  # 32 x 32 sources from here on
    wide = tmp_path / "wide.png"
    Image.new("RGB", (96, 32)).save(wide)
    with pytest.raises(ValueError, match=r"wide.png \(96x32\) resizes to 64x32, but .*square.png to 32x32: every "
                                         r"source of a run must have one aspect ratio"):
        policy.encode([ImagePrompt("make it red", wide)])
    with pytest.raises(ValueError, match=r"a 128x32 source resizes to a side of 0 pixels at source_size=32"):
        policy.source_hw((128, 32))  # the pipeline's rounding to multiples of 32
    bad = tmp_path / "bad.png"
    bad.write_text("not an image")
    with pytest.raises(ValueError, match=r"bad.png of prompt 'make it red' does not open as an image"):
        policy.encode([ImagePrompt("make it red", bad)])


def test_the_edit_world_reads_prompts_with_their_source_images(tmp_path):
    from difrl.config import ConfigError
    from difrl.train.config import load_flow_config
    from difrl.worlds import build_world

    path = make_tiny_pipeline("qwenimage_edit", tmp_path / "tiny", seed=0)
    base = [f"model.path={path}", f"model.prompt_file={EDIT_SET / 'prompts.jsonl'}", "eval.per_digit=1",
            "eval.num_steps=2"]
    cfg = load_flow_config(ROOT / "configs" / "qwenimage_edit_tiny.yaml", base)
    world = build_world("qwenimage_edit", cfg.model.path, cfg)
    records = [json.loads(ln) for ln in (EDIT_SET / "prompts.jsonl").read_text().splitlines()]
    assert world.prompts == [ImagePrompt(r["prompt"], EDIT_SET / r["image"]) for r in records]
    meta = world.metadata(1)  # the record (its "image" as written) for the rewards, and the prompt itself
    assert meta["prompt"] is world.prompts[1] and {**meta, "prompt": str(meta["prompt"])} == {**records[1], "prompt_id": 1}
    metrics, images = world.evaluate(world.policy, per_digit=1, num_steps=2)
    assert images.shape == (4, 3, 32, 32) and metrics["samples"] == 4 and "reward/color" in metrics

    with pytest.raises(ConfigError, match=r"model.prompts.*edits a source image per prompt"):
        load_flow_config(ROOT / "configs" / "qwenimage_edit_tiny.yaml",
                         [*base, "model.prompt_file=null", "model.prompts=[a cat]"])
    no_image = tmp_path / "set.jsonl"
    no_image.write_text('{"prompt": "make it red", "image": "square.png"}\n{"prompt": "a dog"}\n')
    (tmp_path / "square.png").write_bytes(SQUARE.read_bytes())
    cfg = load_flow_config(ROOT / "configs" / "qwenimage_edit_tiny.yaml", [*base, f"model.prompt_file={no_image}"])
    with pytest.raises(ValueError, match=r"set.jsonl, line 2: \"image\" must name the source image's file"):
        build_world("qwenimage_edit", cfg.model.path, cfg)

"""Pipelines built outside difrl: plain diffusers at other sizes than difrl's tiny ones, trained through the entry scripts.

    HF_HUB_OFFLINE=1 python -m pytest tests/test_outside_pipelines.py -q

For each of FLUX.1, SD3 and Wan 2.1 the test builds a pipeline with plain diffusers / transformers
constructors at sizes and scheduler settings of its own (layers, heads, head width, latent channels,
VAE depth, image size, frames, shift), saves it with `save_pretrained`, and then:

a. parity: difrl's ODE sampling of the base model equals a freshly loaded `pipe(...)` for the same seed
   and settings, with the initial latents given by the documented seed-to-noise mapping
   (`difrl.rollout.initial_latents`, docs/guides/real-models.md "Reproducing a difrl sample with plain diffusers");
b. trains it for two iterations with `scripts/train_<kind>.py configs/flux_tiny.yaml model.kind=<kind> ...`;
c. loads the run's `lora/` into a fresh pipeline with plain `load_lora_weights`: no missing or unexpected
   LoRA keys (diffusers' warnings and a tensor-by-tensor comparison), and the LoRA'd pipeline gives
   difrl's samples of the trained policy.

Only the tokenizers come from difrl.models.tiny: text plumbing, not the model under test.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")

from difrl.models.adapters import load_flow_policy  # noqa: E402
from difrl.models.lora_io import load_lora  # noqa: E402
from difrl.models.tiny import tiny_clip_tokenizer, tiny_t5_tokenizer  # noqa: E402
from difrl.rollout import initial_latents, rollout  # noqa: E402
from difrl.utils.io import load_safetensors_checked  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "flux_tiny.yaml"
PROMPTS = ["a green hill", "two cats"]
SEEDS = torch.tensor([5, 9])
TEXT_LEN = 12
STEPS = 4
# (height, width, extra policy options): other sizes than difrl's 32x32 (and Wan's 5 frames)
SIZES = {"flux": (48, 32, {}), "sd3": (32, 48, {}), "wan": (32, 32, {"num_frames": 9})}
GUIDANCE = {"flux": 2.5, "sd3": 3.0, "wan": 2.0}  # FLUX: embedded guidance; SD3 / Wan: true CFG (two forwards)


def _clip_text(cls, tok, hidden: int, projection: int | None = None):
    from transformers import CLIPTextConfig

    cfg = CLIPTextConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=2,
                         num_hidden_layers=1, max_position_embeddings=TEXT_LEN, projection_dim=projection or hidden,
                         bos_token_id=0, eos_token_id=1, pad_token_id=1)
    return cls(cfg)


def _t5(cls_name: str, tok, d_model: int):
    import transformers

    config_cls = getattr(transformers, cls_name.replace("EncoderModel", "Config"))
    cfg = config_cls(vocab_size=len(tok), d_model=d_model, d_kv=4, d_ff=2 * d_model, num_layers=1, num_heads=2,
                     relative_attention_num_buckets=4, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
                     dropout_rate=0.0)
    return getattr(transformers, cls_name)(cfg)


def _image_vae(latent_channels: int):
    # three levels (vae_scale_factor 4, difrl's tiny VAE has two) and other widths
    return diffusers.AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
                                   up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(4, 8, 8),
                                   layers_per_block=1, latent_channels=latent_channels, norm_num_groups=4,
                                   shift_factor=0.1, scaling_factor=0.9)


def build_outside_pipeline(kind: str):
    """A pipeline from plain constructors: sizes, VAE and scheduler settings unlike difrl.models.tiny's."""
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(3)
    if kind == "flux":
        clip_tok, t5_tok = tiny_clip_tokenizer(TEXT_LEN), tiny_t5_tokenizer()
        pipe = diffusers.FluxPipeline(
            transformer=diffusers.FluxTransformer2DModel(
                patch_size=1, in_channels=32, num_layers=2, num_single_layers=2, attention_head_dim=8,
                num_attention_heads=3, joint_attention_dim=24, pooled_projection_dim=20, guidance_embeds=True,
                axes_dims_rope=(2, 2, 4)),
            vae=_image_vae(8),  # 8 latent channels, packed 2x2 -> 32 transformer channels
            text_encoder=_clip_text(CLIPTextModel, clip_tok, 20), tokenizer=clip_tok,
            text_encoder_2=_t5("T5EncoderModel", t5_tok, 24), tokenizer_2=t5_tok,
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(
                shift=1.0, use_dynamic_shifting=True, base_shift=0.3, max_shift=0.9, base_image_seq_len=16,
                max_image_seq_len=1024))
    elif kind == "sd3":
        tok1, tok2, t5_tok = tiny_clip_tokenizer(TEXT_LEN), tiny_clip_tokenizer(TEXT_LEN), tiny_t5_tokenizer()
        pipe = diffusers.StableDiffusion3Pipeline(
            transformer=diffusers.SD3Transformer2DModel(
                sample_size=12, patch_size=2, in_channels=8, num_layers=3, attention_head_dim=6, num_attention_heads=2,
                caption_projection_dim=12, joint_attention_dim=24, pooled_projection_dim=24, out_channels=8,
                pos_embed_max_size=12),
            vae=_image_vae(8),
            text_encoder=_clip_text(CLIPTextModelWithProjection, tok1, 12, 12), tokenizer=tok1,
            text_encoder_2=_clip_text(CLIPTextModelWithProjection, tok2, 12, 12), tokenizer_2=tok2,
            text_encoder_3=_t5("T5EncoderModel", t5_tok, 24), tokenizer_3=t5_tok,
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=2.0))
    else:
        t5_tok = tiny_t5_tokenizer()
        pipe = diffusers.WanPipeline(
            transformer=diffusers.WanTransformer3DModel(
                patch_size=(1, 2, 2), num_attention_heads=3, attention_head_dim=8, in_channels=8, out_channels=8,
                text_dim=24, freq_dim=64, ffn_dim=24, num_layers=1, cross_attn_norm=False, qk_norm="rms_norm_across_heads",
                rope_max_seq_len=16),
            vae=diffusers.AutoencoderKLWan(base_dim=4, z_dim=8, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                           temperal_downsample=[False, True, True],
                                           latents_mean=[0.1 * i - 0.3 for i in range(8)],
                                           latents_std=[1.0 + 0.2 * i for i in range(8)]),
            text_encoder=_t5("UMT5EncoderModel", t5_tok, 24), tokenizer=t5_tok,
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=5.0))
    for comp in pipe.components.values():
        if isinstance(comp, torch.nn.Module):
            comp.eval()
    return pipe


@pytest.fixture(scope="module")
def outside_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("outside_pipelines")
    built = {}

    def get(kind: str) -> Path:
        if kind not in built:
            built[kind] = root / kind
            build_outside_pipeline(kind).save_pretrained(built[kind])
        return built[kind]

    return get


def fresh_pipe(kind: str, path: Path):
    cls = {"flux": diffusers.FluxPipeline, "sd3": diffusers.StableDiffusion3Pipeline, "wan": diffusers.WanPipeline}[kind]
    pipe = cls.from_pretrained(str(path), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def policy_for(kind: str, path: Path):
    h, w, extra = SIZES[kind]
    return load_flow_policy(kind, path, height=h, width=w, max_sequence_length=TEXT_LEN, **extra)


def pipe_call(kind: str, pipe, seeds: torch.Tensor, latent_shape, output_type: str) -> torch.Tensor:
    """Plain diffusers, reproducing difrl's samples: the initial latents from the seeds (difrl.rollout.initial_latents),
    the same number of steps (the pipeline's own sigmas), guidance and text length."""
    h, w, extra = SIZES[kind]
    guidance = {"guidance_scale": GUIDANCE[kind]}
    out = pipe(PROMPTS, height=h, width=w, num_inference_steps=STEPS, latents=initial_latents(seeds, latent_shape),
               output_type=output_type, max_sequence_length=TEXT_LEN, **guidance, **extra)
    return out.frames if kind == "wan" else out.images


def difrl_samples(kind: str, policy, output: str) -> torch.Tensor:
    batch = rollout(policy, PROMPTS, SEEDS, policy.sigma_schedule(STEPS), kernel="ode", guidance=GUIDANCE[kind])
    return batch.x_final if output == "latent" else policy.decode(batch.x_final)


# ---- a. parity with pipe(...) ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["flux", "sd3", "wan"])
def test_base_model_ode_sampling_equals_a_fresh_pipeline_call(kind, outside_dirs):
    path = outside_dirs(kind)
    policy, pipe = policy_for(kind, path), fresh_pipe(kind, path)
    lat = pipe_call(kind, pipe, SEEDS, policy.latent_shape, "latent")
    ours = difrl_samples(kind, policy, "latent")
    # the pipeline's own loop against our sampler, fp32 on both sides: reductions in another order (a few ulp)
    assert lat.shape == ours.shape and (lat - ours).abs().max() < 1e-5
    images = pipe_call(kind, pipe, SEEDS, policy.latent_shape, "pt")
    assert (images - difrl_samples(kind, policy, "pt")).abs().max() < 1e-5
    # the mapping is per seed: one seed's noise does not depend on the others in the batch
    alone = initial_latents(SEEDS[1:], policy.latent_shape)
    assert torch.equal(alone[0], initial_latents(SEEDS, policy.latent_shape)[1])
    assert images.std() > 0.01  # not a degenerate constant image


# ---- b + c. train through the entry script, load the LoRA with plain diffusers -----------------------------

class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.slow  # end to end (three model families, two iterations each): left out by `make test-fast`
@pytest.mark.parametrize("kind", ["flux", "sd3", "wan"])
def test_train_through_entry_script_and_load_lora_with_plain_diffusers(kind, outside_dirs, tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "scripts"))
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    entry = __import__(f"train_{kind}")
    path, run = outside_dirs(kind), tmp_path / "run"
    h, w, extra = SIZES[kind]
    args = [str(CONFIG), f"model.kind={kind}", f"model.path={path}", f"model.height={h}", f"model.width={w}",
            f"model.max_sequence_length={TEXT_LEN}", f"sampler.guidance={GUIDANCE[kind]}", f"sampler.num_steps={STEPS}",
            f"eval.num_steps={STEPS}", "eval.per_digit=1", "train.iterations=2", "rollout.prompts_per_iter=2",
            "rollout.group_size=4", "train.micro_batch=12", "train.grad_accum=1"]
    args += [f"model.{k}={v}" for k, v in extra.items()] + ["--out", str(run)]
    from difrl.train.entry import main

    assert main(kind, args) == 0, entry.__doc__
    lora_file = run / "lora" / "pytorch_lora_weights.safetensors"
    saved = load_safetensors_checked(lora_file, "LoRA")[0]
    assert saved and any(float(v.abs().max()) > 0 for k, v in saved.items() if "lora_B" in k)  # training moved B

    # c. plain diffusers: no missing / unexpected keys, every saved tensor in place
    pipe = fresh_pipe(kind, path)
    handler = _Warnings()
    logging.getLogger("diffusers").addHandler(handler)
    logging.getLogger("peft").addHandler(handler)
    try:
        pipe.load_lora_weights(str(run / "lora"))
    finally:
        logging.getLogger("diffusers").removeHandler(handler)
        logging.getLogger("peft").removeHandler(handler)
    bad = [m for m in handler.messages if "unexpected keys" in m.lower() or "missing keys" in m.lower()]
    assert not bad, bad
    loaded = {n: p for n, p in pipe.transformer.named_parameters() if ".lora_" in n}
    assert len(loaded) == len(saved)
    by_key = {n.replace(".default_0", "").replace(".default", ""): p for n, p in loaded.items()}
    for k, v in saved.items():
        key = k.removeprefix("transformer.")
        assert key in by_key, (key, sorted(by_key)[:4])
        torch.testing.assert_close(by_key[key].detach(), v, rtol=0, atol=0)  # exact: the saved tensors, loaded

    # the LoRA'd plain pipeline samples what difrl samples with the trained LoRA
    policy = load_lora(policy_for(kind, path), run / "lora")
    images = pipe_call(kind, pipe, SEEDS, policy.latent_shape, "pt")
    assert (images - difrl_samples(kind, policy, "pt")).abs().max() < 1e-5
    base = pipe_call(kind, fresh_pipe(kind, path), SEEDS, policy.latent_shape, "pt")
    assert (images - base).abs().max() > 1e-6  # the LoRA changes the samples

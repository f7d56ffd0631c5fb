"""Every diffusers adapter of the table on its tiny random pipeline saved to disk and loaded back.

    HF_HUB_OFFLINE=1 python -m pytest tests/test_diffusers_models.py -q
    HF_HUB_OFFLINE=1 python -m pytest tests/test_diffusers_models.py -q -k example      # one family

The kinds are difrl.models.adapters.ADAPTERS: the built-in families (FLUX.1, SD3, Wan 2.1, Z-Image) and those registered
with @register_model, here tests/model_plugins.py's "example" (a family from outside difrl, every check below at
the cost of the SD3 ones: a few seconds). What a family's checks need is read from its class (pipeline_class,
model_options); a guidance pair and a latent shape written down here are the built-ins' (a registered family uses
(1, 4) and its pipeline's own latent shape). For each model: loading through the path and the errors for bad
directories; the ODE rollout equals the diffusers pipeline's own output (same seeds, sigmas, guidance); ratio 1
when a stored SDE transition is re-scored; LoRA trains only LoRA parameters and round-trips through the diffusers
LoRA format; a LoRA from another model kind is refused; bf16 gives fp32 velocities; the quantization preset names
modules of the transformer; the NFE count is the rows the transformer sees.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")

import model_plugins  # noqa: E402,F401  (tests/ is on sys.path: registers the "example" family)
from difrl.models.base import FlowPolicy  # noqa: E402
from difrl.models.adapters import ADAPTERS, BUILTIN_ADAPTERS, load_flow_policy  # noqa: E402
from difrl.models.diffusers_base import ImagePrompt, ModelKindError, PipelineDirError, check_pipeline_dir  # noqa: E402
from difrl.models.lora_io import LORA_MARKER, load_lora, save_lora  # noqa: E402
from difrl.models.adapters import make_tiny_pipeline  # noqa: E402
from difrl.rollout import INIT_STEP, rollout, sample_noise  # noqa: E402
from difrl.samplers.kernels import KERNELS  # noqa: E402
from difrl.samplers.schedules import fixed_window  # noqa: E402

KINDS = list(ADAPTERS)  # the built-in families and every registered one
SIZE = dict(height=32, width=32)
FRAMES = 5
TEXT_LEN = 16  # max_sequence_length for T5 / UMT5 (the real defaults, 256-512, only cost time here)
PROMPTS = ["a photo of a cat", "a red dog"]
# an editing family's prompts carry source images (the bundled tiny edit set's), resized to SOURCE_SIZE^2 pixels
EDIT_SET = Path(__file__).resolve().parent.parent / "difrl" / "assets" / "edit_tiny"
SOURCE_SIZE = 32
SEEDS = torch.tensor([11, 12])
N_STEPS = 3
# guidance off / on for each model (default: true CFG's 1 and 4); Flux's value is the embedded distilled guidance
GUIDANCE = {"flux": [1.0, 3.5], "flux2": [1.0, 4.0], "zimage": [0.0, 4.0], "qwenimage": [1.0, 4.0],
            "qwenimage_edit": [1.0, 4.0]}  # Z-Image: w > 0 is CFG, 0 one forward
# one sample's latent at 32x32 (Wan: 5 frames), see the family files' docstrings; another family: its pipeline's own
LATENT_SHAPE = {"flux": (64, 16), "sd3": (4, 16, 16), "wan": (16, 2, 4, 4), "sana": (4, 16, 16),
                "flux2": (16, 8, 8),
                "flux2_klein": (16, 8, 8), "zimage": (4, 16, 16),
                "qwenimage": (16, 16), "wan22": (48, 2, 2, 2), "qwenimage_edit": (16, 16)}
# a policy latent as its pipeline returns it for output_type="latent" (default: the same tensor): FLUX.2 [dev] returns
# its tokens [B, h w, 4C], [klein] the VAE latent (batch norm undone, patches unfolded) [B, C, 2h, 2w]
PIPELINE_LATENT = {"flux2": lambda policy, x: policy.pack(x), "flux2_klein": lambda policy, x: policy._vae_latents(x)}
# how a kind's pipeline takes difrl's `guidance` (default: guidance_scale=); Qwen-Image: true_cfg_scale with a negative
# prompt (the policy's default "", which the pipeline needs to do CFG at all)
PIPE_GUIDANCE = {"qwenimage": lambda g: {"true_cfg_scale": g, "negative_prompt": ""},
                 "qwenimage_edit": lambda g: {"true_cfg_scale": g, "negative_prompt": ""}}
ATOL = 1e-5  # fp32 on both sides: the pipeline's own loop against our rollout orders reductions apart (a few ulp)


def guidances(kind: str) -> list[float]:
    return GUIDANCE.get(kind, [1.0, 4.0])


def video(kind: str) -> bool:
    return "num_frames" in ADAPTERS[kind].model_options


def edits(kind: str) -> bool:
    return ADAPTERS[kind].source_images


def prompts_of(kind: str) -> list[str]:
    """PROMPTS; an editing family's carry a source image each (ImagePrompt)."""
    if edits(kind):
        return [ImagePrompt(t, EDIT_SET / f) for t, f in zip(PROMPTS, ("square.png", "circle.png"))]
    return list(PROMPTS)


def policy_options(kind: str) -> dict:
    return dict(SIZE, max_sequence_length=TEXT_LEN, **({"num_frames": FRAMES} if video(kind) else {}),
                **({"source_size": SOURCE_SIZE} if edits(kind) else {}))


def edit_pipe_output(pipe, prompts, kw) -> torch.Tensor:
    """An editing pipeline's own call, row by row (the pipeline sizes a batch by its first image), with its source area
    1024^2 replaced by SOURCE_SIZE^2 (the adapter's source_size; the tiny VAE takes seconds for a 1024^2 image): the
    pipeline module's calculate_dimensions is patched for the call, every other step is the pipeline's."""
    from PIL import Image
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as edit

    latents, orig, out = kw.pop("latents"), edit.calculate_dimensions, []
    edit.calculate_dimensions = lambda area, ratio: orig(SOURCE_SIZE ** 2, ratio)
    try:
        for i, p in enumerate(prompts):
            out.append(pipe(image=Image.open(p.image).convert("RGB"), prompt=str(p), latents=latents[i:i + 1], **kw).images)
    finally:
        edit.calculate_dimensions = orig
    return torch.cat(out)


def dead_lora(policy) -> set[str]:
    """LoRA targets that cannot train: an SD3-type MMDiT's last block is context-pre-only, so its context query
    (attn.add_q_proj) feeds an output that is discarded and its LoRA has no gradient (true of the real SD3 / SD3.5
    too); every other one trains."""
    cfg = policy.transformer_config
    if type(policy.pipe.transformer).__name__ == "SD3Transformer2DModel":
        return {f"transformer_blocks.{cfg.num_layers - 1}.attn.add_q_proj"}
    if type(policy.pipe.transformer).__name__ == "QwenImageTransformer2DModel":  # the last block's text-stream output
        # is discarded (only the image stream reaches proj_out), so what only writes it has no gradient
        return {f"transformer_blocks.{cfg.num_layers - 1}.{t}" for t in ("attn.add_q_proj", "attn.to_add_out",
                                                                          "txt_mlp.net.0.proj", "txt_mlp.net.2")}
    return set()


def other_kind(kind: str) -> str:
    """The next kind of the table whose pipeline class differs (its directories and LoRAs are another model's)."""
    order = KINDS[KINDS.index(kind) + 1:] + KINDS[:KINDS.index(kind)]
    return next(k for k in order if ADAPTERS[k].pipeline_class != ADAPTERS[kind].pipeline_class)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """kind -> a tiny pipeline directory, each built once on first use."""
    root = tmp_path_factory.mktemp("tiny_pipelines")
    built = {}

    def get(kind: str):
        if kind not in built:
            built[kind] = make_tiny_pipeline(kind, root / kind, seed=0)
        return built[kind]

    return get


@pytest.fixture(scope="module")
def policies(tiny_dirs):
    """kind -> the adapter loaded from its directory (shared, never LoRA-wrapped)."""
    cache = {}

    def get(kind: str):
        if kind not in cache:
            cache[kind] = load_flow_policy(kind, tiny_dirs(kind), **policy_options(kind))
        return cache[kind]

    return get


def fresh_pipe(kind, path):
    pipe = getattr(diffusers, ADAPTERS[kind].pipeline_class).from_pretrained(str(path), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def pipe_output(kind, pipe, latents, guidance, output_type, **extra):
    """The pipeline's own call on the same prompts, initial latents and number of steps."""
    kw = dict(SIZE, num_inference_steps=N_STEPS, latents=latents.clone(), output_type=output_type,
              max_sequence_length=TEXT_LEN, **PIPE_GUIDANCE.get(kind, lambda g: {"guidance_scale": g})(guidance), **extra)
    if video(kind):
        return pipe(prompt=list(PROMPTS), num_frames=FRAMES, **kw).frames  # [B, F, C, H, W]: difrl's video layout too
    if edits(kind):
        return edit_pipe_output(pipe, prompts_of(kind), kw)
    # by name: FLUX.2's first argument is a conditioning image; a copy: ZImagePipeline rewrites the list in place
    return pipe(prompt=list(PROMPTS), **kw).images


# ---- a. loading and bad directories ----------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_loads_from_path_with_protocol_shapes(kind, policies):
    policy = policies(kind)
    assert isinstance(policy, FlowPolicy) and policy.kind == kind
    if kind in LATENT_SHAPE:  # a registered family's: test_ode_rollout_equals_pipeline checks it against the pipeline
        assert tuple(policy.latent_shape) == LATENT_SHAPE[kind]
    assert policy.lora_target_modules and all(isinstance(t, str) for t in policy.lora_target_modules)
    cond = policy.encode(prompts_of(kind))
    assert all(v.shape[0] == 2 for v in cond.values())
    x = torch.randn(2, *policy.latent_shape)
    v = policy.velocity(x, torch.tensor([0.9, 0.4]), cond, guidance=guidances(kind)[1])
    assert v.dtype == torch.float32 and v.shape == x.shape and torch.isfinite(v).all()
    img = policy.decode(x)
    assert img.dtype == torch.float32 and 0 <= img.min() and img.max() <= 1
    assert img.shape == ((2, FRAMES, 3, 32, 32) if video(kind) else (2, 3, 32, 32))


@pytest.mark.parametrize("kind", KINDS)
def test_bad_directories_name_the_problem(kind, tiny_dirs, tmp_path):
    good = tiny_dirs(kind)
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="nowhere: no such directory"):
        load_flow_policy(kind, missing)

    no_index = tmp_path / "no_index"
    shutil.copytree(good, no_index)
    (no_index / "model_index.json").unlink()
    with pytest.raises(PipelineDirError, match=r"no_index has no model_index\.json"):
        load_flow_policy(kind, no_index)

    no_transformer = tmp_path / "no_transformer"
    shutil.copytree(good, no_transformer)
    shutil.rmtree(no_transformer / "transformer")
    with pytest.raises(PipelineDirError, match=r"no_transformer is missing component 'transformer'"):
        load_flow_policy(kind, no_transformer)

    # a directory of another model kind: model_index.json names another pipeline class
    other = other_kind(kind)
    other_class = ADAPTERS[other].pipeline_class
    wrong = tmp_path / "wrong_kind"
    shutil.copytree(good, wrong)
    index = json.loads((wrong / "model_index.json").read_text())
    index["_class_name"] = other_class
    (wrong / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ModelKindError, match=rf"wrong_kind holds a {other_class}.*that is kind .*'{other}'"):
        load_flow_policy(kind, wrong)
    assert check_pipeline_dir(good, ADAPTERS[kind]) == good

    with pytest.raises(ValueError, match="unknown model kind"):
        load_flow_policy("sdxl", good)


# ---- b. ODE rollout == pipeline --------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_ode_rollout_equals_pipeline(kind, policies):
    policy = policies(kind)
    sigmas = policy.sigma_schedule(N_STEPS)
    latents0 = sample_noise(SEEDS, INIT_STEP, tuple(policy.latent_shape))  # the rollout's initial noise
    for guidance in guidances(kind):
        batch = rollout(policy, prompts_of(kind), SEEDS, sigmas, kernel="ode", guidance=guidance)
        lat = pipe_output(kind, policy.pipe, latents0, guidance, "latent")
        final = PIPELINE_LATENT.get(kind, lambda policy, x: x)(policy, batch.x_final)
        assert lat.shape == final.shape, (kind, lat.shape)  # latent_shape is the pipeline's latent
        # the helper gives the pipeline's schedule (Flux: dynamic shift mu from the sequence length)
        torch.testing.assert_close(policy.pipe.scheduler.sigmas.float().cpu(), sigmas, rtol=0, atol=0)  # the same
        # scheduler's values (exact)
        assert (lat - final).abs().max() < ATOL, (kind, guidance)
        images = pipe_output(kind, policy.pipe, latents0, guidance, "pt")
        assert (images - policy.decode(batch.x_final)).abs().max() < ATOL, (kind, guidance)


def test_flux_true_cfg_equals_pipeline(tiny_dirs):
    policy = load_flow_policy("flux", tiny_dirs("flux"), true_cfg_scale=2.5, negative_prompt="blurry",
                              **policy_options("flux"))
    sigmas = policy.sigma_schedule(N_STEPS)
    latents0 = sample_noise(SEEDS, INIT_STEP, tuple(policy.latent_shape))
    batch = rollout(policy, PROMPTS, SEEDS, sigmas, kernel="ode", guidance=3.5)
    lat = pipe_output("flux", policy.pipe, latents0, 3.5, "latent", true_cfg_scale=2.5, negative_prompt="blurry")
    assert (lat - batch.x_final).abs().max() < ATOL
    plain = rollout(load_flow_policy("flux", tiny_dirs("flux"), **policy_options("flux")), PROMPTS, SEEDS, sigmas,
                    kernel="ode", guidance=3.5)
    assert (plain.x_final - batch.x_final).abs().max() > 1e-3  # the uncond pass did change the result


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_model_returns_fp32_velocity(kind, tiny_dirs, policies):
    low = load_flow_policy(kind, tiny_dirs(kind), dtype="bf16", **policy_options(kind))
    assert low.module.dtype == torch.bfloat16 and low.pipe.text_encoder.dtype == torch.bfloat16
    full = policies(kind)
    x = sample_noise(SEEDS, 0, tuple(full.latent_shape))
    sigma, guidance = torch.tensor([0.9, 0.3]), guidances(kind)[-1]
    v_low = low.velocity(x, sigma, low.encode(prompts_of(kind)), guidance)
    v_full = full.velocity(x, sigma, full.encode(prompts_of(kind)), guidance)
    assert v_low.dtype == torch.float32
    assert (v_low - v_full).abs().max() < 0.1 * v_full.abs().max()  # bf16 rounding, not a different model
    assert low.decode(x).dtype == torch.float32


def test_flux_guidance_on_a_model_without_guidance_embedding_is_refused(tiny_dirs):
    from types import SimpleNamespace

    policy = load_flow_policy("flux", tiny_dirs("flux"), **policy_options("flux"))
    policy.transformer_config = SimpleNamespace(guidance_embeds=False)  # as FLUX.1-schnell's config says
    x, cond = torch.zeros(2, *policy.latent_shape), policy.encode(PROMPTS)
    with pytest.raises(ValueError, match="no guidance embedding"):
        policy.velocity(x, torch.tensor([0.5, 0.5]), cond, guidance=3.5)


def test_prompt_cache_gives_the_same_embeddings(tiny_dirs, policies):
    cached = load_flow_policy("flux", tiny_dirs("flux"), cache_prompts=True, **policy_options("flux"))
    plain = policies("flux").encode(PROMPTS + PROMPTS[:1])
    got = cached.encode(PROMPTS + PROMPTS[:1])
    assert set(cached._cache) == set(PROMPTS)  # each prompt encoded once
    for k in plain:
        assert (got[k] - plain[k]).abs().max() < 1e-6  # encoded in another batch of prompts: fp32 reordering


# ---- c. ratio 1 --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_rescored_sde_transitions_have_ratio_one(kind, policies):
    policy = policies(kind)
    sigmas = policy.sigma_schedule(N_STEPS)
    window = fixed_window(N_STEPS, 0, 2)
    for guidance in guidances(kind):
        batch = rollout(policy, prompts_of(kind), SEEDS, sigmas, kernel="flow_sde", kernel_kwargs={"noise_level": 0.7},
                        sde_mask=window, train_mask=window, guidance=guidance)
        assert batch.log_prob_old.shape == (2, 2) and (batch.log_prob_old != 0).all()
        for t in range(batch.x.shape[1]):
            v = policy.velocity(batch.x[:, t], batch.sigma[:, t], batch.cond, guidance)
            out = KERNELS["flow_sde"](batch.x[:, t], v, batch.sigma[:, t], batch.sigma_next[:, t],
                                      action=batch.x_next[:, t], noise_level=0.7)
            # the step re-scored outside the sampler (another call, maybe another kernel): fp32, a few ulp of O(1..10)
            assert (out.log_prob - batch.log_prob_old[:, t]).abs().max() < 1e-5, (kind, guidance, t)


# ---- d. LoRA --------------------------------------------------------------------------------------------

def _lora_wrap(policy, seed=0):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    net = get_peft_model(policy.module, LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian",
                                                   target_modules=policy.lora_target_modules))
    policy.module = net
    return net


def _two_lora_steps(policy, net, lora: dict, guidance: float) -> tuple[dict, set[str]]:
    """Two AdamW steps on the squared velocity (B starts at 0, so A gets its first gradient in the second step).
    Returns the parameters after and the LoRA-wrapped modules none of whose LoRA weights changed (exactly equal)."""
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2)
    cond, x = policy.encode(prompts_of(policy.kind)), sample_noise(SEEDS, 0, tuple(policy.latent_shape))
    for _ in range(2):
        loss = policy.velocity(x, torch.tensor([0.8, 0.5]), cond, guidance).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = dict(net.named_parameters())
    unchanged = {k.split(".lora_")[0].removeprefix("base_model.model.") for k, v in lora.items()
                 if torch.equal(after[k], v)}
    return after, unchanged


@pytest.mark.parametrize("kind", KINDS)
def test_lora_trains_only_lora_and_round_trips(kind, tiny_dirs, policies, tmp_path):
    path = tiny_dirs(kind)
    policy = load_flow_policy(kind, path, **policy_options(kind))
    net = _lora_wrap(policy)
    lora = {k: p.detach().clone() for k, p in net.named_parameters() if "lora_" in k}
    base = {k: p.detach().clone() for k, p in net.named_parameters() if "lora_" not in k}
    assert lora and all(p.requires_grad for k, p in net.named_parameters() if "lora_" in k)
    wrapped = {n.split(".lora_")[0] for n in lora}
    assert all(any(w.endswith("." + t) for w in wrapped) for t in policy.lora_target_modules)

    guidance = guidances(kind)[-1]
    after, unchanged = _two_lora_steps(policy, net, lora, guidance)
    assert unchanged == dead_lora(policy), unchanged  # every LoRA trains but the structurally dead ones
    assert all(torch.equal(after[k], v) for k, v in base.items()), "a base parameter changed"

    lora_dir = save_lora(policy, tmp_path / "lora")
    assert (lora_dir / "pytorch_lora_weights.safetensors").is_file() and (lora_dir / LORA_MARKER).is_file()
    sigmas = policy.sigma_schedule(N_STEPS)
    with torch.no_grad():
        trained = policy.decode(rollout(policy, prompts_of(kind), SEEDS, sigmas, kernel="ode", guidance=guidance).x_final)

    # a fresh pipeline + diffusers' own load_lora_weights gives the trained policy's images (alpha kept)
    pipe = fresh_pipe(kind, path)
    pipe.load_lora_weights(str(lora_dir))
    latents0 = sample_noise(SEEDS, INIT_STEP, tuple(policy.latent_shape))
    images = pipe_output(kind, pipe, latents0, guidance, "pt")
    assert (images - trained).abs().max() < ATOL
    base_images = pipe_output(kind, policies(kind).pipe, latents0, guidance, "pt")
    assert (base_images - trained).abs().max() > 1e-4  # the LoRA matters

    # load_lora into a fresh plain policy, and into a freshly peft-wrapped one (training resume)
    for wrap in (False, True):
        other = load_flow_policy(kind, path, **policy_options(kind))
        if wrap:
            _lora_wrap(other, seed=1)
        load_lora(other, lora_dir)
        with torch.no_grad():
            again = other.decode(rollout(other, prompts_of(kind), SEEDS, sigmas, kernel="ode", guidance=guidance).x_final)
        assert (again - trained).abs().max() < ATOL, wrap


@pytest.mark.parametrize("kind", KINDS)
def test_lora_from_another_kind_is_refused(kind, tiny_dirs, policies, tmp_path):
    other = other_kind(kind)
    source = load_flow_policy(other, tiny_dirs(other), **policy_options(other))
    _lora_wrap(source)
    lora_dir = save_lora(source, tmp_path / f"{other}_lora")
    target = policies(kind)
    with pytest.raises(ModelKindError, match=rf"{other}_lora holds a LoRA for model kind '{other}'"):
        load_lora(target, lora_dir)
    # without difrl's marker (a LoRA from elsewhere) the tensors themselves do not fit
    (lora_dir / LORA_MARKER).unlink()
    with pytest.raises(ModelKindError, match=rf"{other}_lora does not fit this {type(target.pipe.transformer).__name__}"):
        load_lora(target, lora_dir)
    assert not hasattr(target.module, "peft_config")  # nothing was loaded into the refused policy

    with pytest.raises(PipelineDirError, match="no such LoRA directory"):
        load_lora(target, tmp_path / "none")


def test_the_kinds_are_the_table_with_the_registered_family():
    assert {"flux", "sd3", "wan"} <= set(BUILTIN_ADAPTERS) and "example" not in BUILTIN_ADAPTERS
    assert KINDS == list(ADAPTERS) and set(KINDS) >= set(BUILTIN_ADAPTERS) | {"example"}


def test_every_adapter_is_a_flow_world():
    from difrl.worlds import FLOW_KINDS, WORLDS, flow_kinds

    # the bundled worlds (digits, moving digits) and one world per diffusers adapter, the registered ones too
    assert FLOW_KINDS == tuple(WORLDS) and FLOW_KINDS[0] == "digits"
    assert set(FLOW_KINDS) == {"digits", "moving_digits"} | set(BUILTIN_ADAPTERS)
    assert flow_kinds()[:2] == ("digits", "moving_digits") and set(flow_kinds()) >= set(FLOW_KINDS) | set(ADAPTERS)


@pytest.mark.parametrize("kind", KINDS)
def test_quant_preset_skips_name_modules_of_the_transformer(kind, policies):
    """The trainer quantizes a rollout copy with `policy.quant_preset`: a skip pattern that names no module of
    the transformer (a typo, or another model's name) would quantize the layer it meant to keep exact."""
    preset = policies(kind).quant_preset
    assert set(preset) == {"skip", "min_dim"} and preset["skip"]
    names = [n for n, _ in policies(kind).module.named_modules()]
    assert [s for s in preset["skip"] if not any(s in n for n in names)] == []


@pytest.mark.parametrize("kind", KINDS)
def test_block_classes_are_the_transformers_repeated_unsplittable_blocks(kind, policies):
    """FSDP2 shards the transformer by `block_classes` (difrl.train.dist.sharding; none found: it raises) and
    model.compile compiles them: each must name blocks of the transformer, repeated, that diffusers declares
    unsplittable (_no_split_modules)."""
    policy = policies(kind)
    transformer = policy.pipe.transformer
    assert policy.block_classes and set(policy.block_classes) <= set(type(transformer)._no_split_modules)
    counts = {c: sum(type(m).__name__ == c for m in transformer.modules()) for c in policy.block_classes}
    assert sum(counts.values()) >= 2 and all(counts.values()), counts


def test_wan_rollout_copy_with_no_layer_skipped(policies, tiny_dirs):
    # rollout.quant_skip=[] quantizes Wan's time embedder too (quant_min_dim=0: at this size every layer is small);
    # diffusers' WanTimeTextImageEmbedding reads its dtype as next(time_embedder.parameters()).dtype, which a
    # quantized layer's bias provides (a frozen parameter, as in nn.Linear); before, StopIteration
    from difrl.train.config import load_flow_config
    from difrl.train.flow.trainer import build_rollout_copy
    from difrl.train.precision import MasterWeights

    policy = policies("wan")
    cfg = load_flow_config(Path(__file__).resolve().parent.parent / "configs" / "wan_tiny.yaml", [f"model.path={tiny_dirs('wan')}", "rollout.precision=fp8_row",
                                                      "rollout.quant_skip=[]", "rollout.quant_min_dim=0"])
    copy, _ = build_rollout_copy(cfg, policy, policy.module, MasterWeights(), lambda msg: None)  # nothing upcast
    quantized = set(copy.report.quantized)
    assert {"condition_embedder.time_embedder.linear_1", "condition_embedder.time_embedder.linear_2"} <= quantized
    assert not [r for r in copy.report.rows if r[2] == "skipped"]
    x = torch.randn(2, *policy.latent_shape, generator=torch.Generator().manual_seed(0))
    sigma, cond = torch.tensor([0.7, 0.3]), policy.encode(PROMPTS)
    with torch.no_grad():
        v = policy.velocity(x, sigma, cond, 1.0)
        with copy.active(policy):
            v_q = policy.velocity(x, sigma, cond, 1.0)
    err = float((v_q - v).norm() / v.norm())
    assert 0 < err < 0.1, err  # quantized (not the policy itself), and close to it (0.033 when written)


@pytest.mark.parametrize("kind", KINDS)
def test_forwards_per_step_counts_the_rows_the_transformer_sees(kind, tiny_dirs, policies):
    # the trainer's NFE counts (difrl.models.base.forwards_per_step): network evaluations per sample of one velocity
    # call = rows through the transformer / samples. FLUX's guidance is embedded (one row whatever its value); SD3 and
    # Wan do CFG for guidance > 1 (two rows: [uncond; cond]); a FLUX with true_cfg_scale > 1 too
    from difrl.models.base import forwards_per_step

    def rows_seen(policy, guidance):
        seen = []
        hook = policy.pipe.transformer.register_forward_hook(
            lambda m, args, kwargs, out: seen.append(len(kwargs.get("hidden_states", kwargs.get("x")))),
            with_kwargs=True)  # Z-Image's transformer takes a list of samples, x
        try:
            x = sample_noise(SEEDS, INIT_STEP, tuple(policy.latent_shape))
            policy.velocity(x, torch.full((len(SEEDS),), 0.5), policy.encode(prompts_of(policy.kind)), guidance=guidance)
        finally:
            hook.remove()
        return sum(seen) // len(SEEDS)

    policy = policies(kind)
    for guidance in (1.0, 3.5):
        assert forwards_per_step(policy, guidance) == rows_seen(policy, guidance), (kind, guidance)
    if kind in BUILTIN_ADAPTERS:
        assert forwards_per_step(policy, 3.5) == (1 if kind in ("flux", "flux2") else 2)  # embedded guidance: 1
    if kind == "flux":
        cfg = load_flow_policy("flux", tiny_dirs("flux"), true_cfg_scale=2.5, **policy_options("flux"))
        assert forwards_per_step(cfg, 3.5) == rows_seen(cfg, 3.5) == 2


# ---- SD3.5-Medium's shape through kind sd3 ---------------------------------------------------------------

def test_sd35_medium_shape_equals_its_pipeline_and_its_lora_loads(tmp_path):
    # SD3.5-Medium is kind sd3 with RMS qk-norm and dual-attention blocks (attn2): the ODE rollout is its pipeline's
    # output (guidance off and on), and a LoRA of the joint attention's projections (attn2 left out, as Flow-GRPO,
    # Flow-Factory and diffusers' SD3 LoRA script do: difrl/models/sd3.py) trains and loads into a plain pipeline
    path = make_tiny_pipeline("sd3", tmp_path / "sd35m", seed=0, variant="sd3.5-medium")
    policy = load_flow_policy("sd3", path, **policy_options("sd3"))
    blocks = policy.pipe.transformer.transformer_blocks
    assert blocks[0].attn2 is not None and blocks[1].attn2 is None
    assert type(blocks[0].attn.norm_q).__name__ == type(blocks[0].attn2.norm_q).__name__ == "RMSNorm"
    sigmas = policy.sigma_schedule(N_STEPS)
    latents0 = sample_noise(SEEDS, INIT_STEP, tuple(policy.latent_shape))
    for guidance in guidances("sd3"):
        batch = rollout(policy, PROMPTS, SEEDS, sigmas, kernel="ode", guidance=guidance)
        lat = pipe_output("sd3", policy.pipe, latents0, guidance, "latent")
        assert (lat - batch.x_final).abs().max() < ATOL, guidance  # fp32 summation order only

    net = _lora_wrap(policy)
    lora = {k: p.detach().clone() for k, p in net.named_parameters() if "lora_" in k}
    assert lora and not [k for k in lora if ".attn2." in k]  # the dual attention is not a target
    guidance = 4.0
    _, unchanged = _two_lora_steps(policy, net, lora, guidance)
    assert unchanged == dead_lora(policy), unchanged
    lora_dir = save_lora(policy, tmp_path / "lora")
    with torch.no_grad():
        trained = policy.decode(rollout(policy, PROMPTS, SEEDS, sigmas, kernel="ode", guidance=guidance).x_final)
    pipe = fresh_pipe("sd3", path)
    pipe.load_lora_weights(str(lora_dir))
    assert (pipe_output("sd3", pipe, latents0, guidance, "pt") - trained).abs().max() < ATOL
def test_qwenimage_embeddings_are_the_pipelines_padded_with_their_mask(policies):
    # the adapter gathers the pipeline's text-encoder states with static shapes (difrl plan runs it on fake tensors) and
    # pads every prompt to max_sequence_length: the pipeline's own encode_prompt, then zeros, bit for bit (a copy)
    policy = policies("qwenimage")
    prompts = ["a photo of a cat", "a red dog", "a much longer prompt than the others, truncated at sixteen tokens"]
    cond = policy.encode(prompts)
    embeds, mask = policy.pipe.encode_prompt(prompts, max_sequence_length=TEXT_LEN)
    n = embeds.shape[1]
    assert cond["prompt_embeds"].shape == (3, TEXT_LEN, embeds.shape[2]) and n <= TEXT_LEN
    assert torch.equal(cond["prompt_embeds"][:, :n], embeds) and not cond["prompt_embeds"][:, n:].any()
    assert torch.equal(cond["prompt_embeds_mask"][:, :n], mask) and not cond["prompt_embeds_mask"][:, n:].any()
    assert cond["prompt_embeds_mask"].sum(1).tolist()[2] == TEXT_LEN  # the long prompt fills it (truncated)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):  # what difrl plan runs
        assert policy._encode_batch(prompts)["prompt_embeds"].shape == (3, TEXT_LEN, embeds.shape[2])

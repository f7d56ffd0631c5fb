"""What is SANA's own (difrl/models/sana.py) beyond the checks every family gets (tests/test_diffusers_models.py):
the published checkpoints' DPM-Solver scheduler, the complex human instruction, and the low-precision copy's layers.

    HF_HUB_OFFLINE=1 python -m pytest tests/test_sana.py -q

On the tiny SANA pipeline (difrl/models/sana.py tiny_pipeline), saved once for the module.
"""

from __future__ import annotations

import copy

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from difrl.models.adapters import load_flow_policy, make_tiny_pipeline  # noqa: E402
from difrl.models.sana import default_instruction  # noqa: E402
from difrl.quant.linear import quantize_module  # noqa: E402
from difrl.rollout import INIT_STEP, rollout, sample_noise  # noqa: E402

PROMPTS = ["a photo of a cat", "a red dog"]
SEEDS = torch.tensor([11, 12])
OPTIONS = dict(height=32, width=32, max_sequence_length=16)
N_STEPS = 3
# the published Sana_1600M_1024px_diffusers scheduler, the default of
# huggingface/diffusers scripts/convert_sana_to_diffusers.py
DPM_FLOW = dict(flow_shift=3.0, use_flow_sigmas=True, prediction_type="flow_prediction")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_pipeline("sana", tmp_path_factory.mktemp("tiny") / "sana", seed=0)


def with_scheduler(path, tmp_path, scheduler):
    """A copy of the tiny pipeline directory whose scheduler is `scheduler`."""
    pipe = diffusers.SanaPipeline.from_pretrained(str(path), local_files_only=True)
    pipe.scheduler = scheduler
    pipe.save_pretrained(tmp_path / "sched")
    return tmp_path / "sched"


def test_the_published_dpm_solver_scheduler_rolls_out_on_the_flow_euler_sigmas(tiny, tmp_path):
    # The real checkpoints ship a flow DPM-Solver++ (second order, multistep); difrl takes one Euler step per sigma, over
    # FlowMatchEulerDiscreteScheduler(shift=flow_shift)'s sigmas (SANA's flow_euler sampler, Sol-RL's `flow` solver).
    # Before: "DPMSolverMultistepScheduler is not a flow-matching Euler scheduler" for every published SANA directory.
    path = with_scheduler(tiny, tmp_path, diffusers.DPMSolverMultistepScheduler(**DPM_FLOW))
    policy = load_flow_policy("sana", path, **OPTIONS)
    euler = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    euler.set_timesteps(N_STEPS)
    sigmas = policy.sigma_schedule(N_STEPS)
    torch.testing.assert_close(sigmas, euler.sigmas.float(), rtol=0, atol=0)  # the same numbers, same code path

    # the module docstring's recipe: the pipeline with the Euler scheduler takes the rollout's steps
    batch = rollout(policy, PROMPTS, SEEDS, sigmas, kernel="ode", guidance=1.0)
    pipe = policy.pipe
    pipe.scheduler = euler
    latents0 = sample_noise(SEEDS, INIT_STEP, tuple(policy.latent_shape))
    out = pipe(PROMPTS, **OPTIONS, num_inference_steps=N_STEPS, guidance_scale=1.0, latents=latents0.clone(),
               output_type="latent").images
    # fp32 on the same ops in the same order: equal to float rounding (0 when written)
    assert (out - batch.x_final).abs().max() < 1e-5


def test_a_scheduler_that_is_no_flow_scheduler_is_refused_by_name(tiny, tmp_path):
    path = with_scheduler(tiny, tmp_path, diffusers.DPMSolverMultistepScheduler())  # epsilon prediction, no flow sigmas
    policy = load_flow_policy("sana", path, **OPTIONS)
    with pytest.raises(ValueError, match="DPMSolverMultistepScheduler is not a flow-matching Euler scheduler"):
        policy.sigma_schedule(N_STEPS)


def test_prompts_carry_the_pipelines_complex_human_instruction(tiny):
    policy = load_flow_policy("sana", tiny, **OPTIONS)
    assert default_instruction() and policy.complex_human_instruction == list(default_instruction())

    def pipeline_embeds(instruction):
        embeds, mask, _, _ = policy.pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=False,
                                                       max_sequence_length=16, complex_human_instruction=instruction)
        return embeds, mask

    cond = policy.encode(PROMPTS)
    embeds, mask = pipeline_embeds(list(default_instruction()))
    # exact: our encode and the pipeline's encode_prompt run the same text encoder on the same tokens
    assert torch.equal(cond["prompt_embeds"], embeds) and torch.equal(cond["prompt_attention_mask"], mask)
    plain = load_flow_policy("sana", tiny, complex_human_instruction=[], **OPTIONS).encode(PROMPTS)
    embeds, mask = pipeline_embeds(None)
    assert torch.equal(plain["prompt_embeds"], embeds) and torch.equal(plain["prompt_attention_mask"], mask)
    # the instruction changes what the transformer sees (the kept tokens are the instruction's first and the prompt's)
    assert not torch.allclose(plain["prompt_embeds"], cond["prompt_embeds"], rtol=1e-5, atol=1e-6)  # far apart
    # the negative prompt is encoded without it, as the pipeline encodes its negative prompt
    negative = policy.negative_cond(1)
    embeds, *_ = policy.pipe.encode_prompt([""], do_classifier_free_guidance=False, max_sequence_length=16,
                                          complex_human_instruction=None)
    assert torch.equal(negative["prompt_embeds"], embeds)


def test_the_low_precision_copy_quantizes_the_layers_sol_rl_quantizes(tiny):
    # Sol-RL quantizes SANA's cross-attention kv_linear (and its LinearFFN); in diffusers' names the split K and V
    # projections, every other linear kept exact (difrl/quant/linear.py QUANT_PRESETS["sana"]). Before: the native
    # names (t_embedder, attn.qkv, ...) matched no diffusers module and min_dim 2240 kept every layer exact.
    policy = load_flow_policy("sana", tiny, **OPTIONS)
    report = quantize_module(copy.deepcopy(policy.pipe.transformer), "nvfp4", **policy.quant_preset)
    n = policy.transformer_config.num_layers
    assert sorted(report.quantized) == sorted(f"transformer_blocks.{i}.attn2.to_{p}" for i in range(n) for p in "kv")

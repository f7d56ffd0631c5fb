"""Wan 2.2 beyond what the parametrised family tests check (they run kind wan22 on its tiny TI2V pipeline): per-token
timesteps of mixed rows, and the two-expert A14B layout (difrl/models/wan22.py) on a tiny two-expert pipeline.

    HF_HUB_OFFLINE=1 python -m pytest tests/test_wan22.py -q

TI2V: a batch whose rows have different sigmas (a training micro-batch) gives each row what it gives alone. A14B: the
ODE rollout equals WanPipeline.__call__ with guidance off, on, and on with guidance_scale_2 for the low-noise expert;
rows are routed per sigma; LoRA on both experts (or one: model.train_experts) round-trips through the pipeline's own
load_lora_weights (lora/ and lora/transformer_2 with load_into_transformer_2=True); two training iterations through
train(cfg) train what train_experts says, and a full fine-tune writes transformer/ and transformer_2/ that load with
from_pretrained and reproduce the trained policy.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")

from difrl.models.adapters import load_flow_policy  # noqa: E402
from difrl.models.wan22 import Wan22Policy, WanExperts  # noqa: E402
from difrl.rollout import INIT_STEP, rollout, sample_noise  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OPTIONS = dict(height=32, width=32, num_frames=5, max_sequence_length=16)
PROMPTS, SEEDS, N_STEPS = ["a photo of a cat", "a red dog"], torch.tensor([11, 12]), 4
ATOL = 1e-5  # fp32 on both sides; the sub-batches of the routing change the reductions' order by a few ulps (1e-6 seen)


@pytest.fixture(scope="module")
def two_expert_dir(tmp_path_factory):
    torch.manual_seed(0)
    pipe = Wan22Policy.tiny_two_expert_pipeline()
    path = tmp_path_factory.mktemp("wan22_a14b") / "pipe"
    pipe.save_pretrained(path)
    return path


def fresh_pipe(path):
    pipe = diffusers.WanPipeline.from_pretrained(str(path), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def pipe_latents(pipe, latents, guidance, guidance_2=None, output_type="latent"):
    return pipe(PROMPTS, num_frames=5, height=32, width=32, num_inference_steps=N_STEPS, guidance_scale=guidance,
                guidance_scale_2=guidance_2, latents=latents.clone(), output_type=output_type,
                max_sequence_length=16).frames


def test_ti2v_rows_of_different_sigmas_each_get_their_own_timestep(tmp_path):
    from difrl.models.adapters import make_tiny_pipeline

    policy = load_flow_policy("wan22", make_tiny_pipeline("wan22", tmp_path / "ti2v"), **OPTIONS)
    x = sample_noise(SEEDS, 0, tuple(policy.latent_shape))
    cond, sigma = policy.encode(PROMPTS), torch.tensor([0.9, 0.2])
    together = policy.velocity(x, sigma, cond)
    for b in range(2):
        alone = policy.velocity(x[b:b + 1], sigma[b:b + 1], {k: v[b:b + 1] for k, v in cond.items()})
        assert (together[b:b + 1] - alone).abs().max() < ATOL, b
    assert (together[1] - policy.velocity(x[1:], sigma[:1], {k: v[1:] for k, v in cond.items()})[0]).abs().max() > 1e-3


def test_two_expert_ode_rollout_equals_the_pipeline_guidance_off_on_and_guidance_scale_2(two_expert_dir):
    policy = load_flow_policy("wan22", two_expert_dir, **OPTIONS)
    assert isinstance(policy.module, WanExperts) and tuple(policy.latent_shape) == (16, 2, 4, 4)
    sigmas = policy.sigma_schedule(N_STEPS)
    assert ((sigmas[:-1] * 1000 >= 700).tolist()) == [True, True, False, False]  # both experts take steps
    latents0 = sample_noise(SEEDS, INIT_STEP, tuple(policy.latent_shape))
    outs = []
    for guidance, guidance_2 in ((1.0, None), (4.0, None), (4.0, 1.5)):
        policy.guidance_scale_2 = guidance_2
        batch = rollout(policy, PROMPTS, SEEDS, sigmas, kernel="ode", guidance=guidance)
        lat = pipe_latents(policy.pipe, latents0, guidance, guidance_2)
        assert (lat - batch.x_final).abs().max() < ATOL, (guidance, guidance_2)
        outs.append(batch.x_final)
        if guidance_2 is not None:
            frames = pipe_latents(policy.pipe, latents0, guidance, guidance_2, output_type="pt")
            assert (frames - policy.decode(batch.x_final)).abs().max() < ATOL
    assert (outs[2] - outs[1]).abs().max() > 1e-3  # guidance_scale_2 did change the low-noise steps


def test_rows_are_routed_per_sigma_and_every_needed_expert_runs(two_expert_dir):
    policy = load_flow_policy("wan22", two_expert_dir, **OPTIONS)
    seen = {"transformer": [], "transformer_2": []}
    for name in seen:
        getattr(policy.pipe, name).register_forward_hook(
            lambda m, a, k, out, name=name: seen[name].append(k["timestep"].tolist()), with_kwargs=True)
    x = sample_noise(SEEDS, 0, tuple(policy.latent_shape))
    cond, sigma = policy.encode(PROMPTS), torch.tensor([0.9, 0.3])  # boundary 0.7: row 0 high noise, row 1 low
    together = policy.velocity(x, sigma, cond)
    # timesteps are fp32 sigma x 1000: 0.9 happens to round to 900 exactly, 0.3 to within an ulp of 300
    assert seen == {"transformer": [[900.0]], "transformer_2": [[pytest.approx(300.0, rel=1e-6)]]}
    for b, name in ((0, "transformer"), (1, "transformer_2")):
        alone = getattr(policy.pipe, name)(hidden_states=x[b:b + 1], timestep=sigma[b:b + 1] * 1000,
                                            encoder_hidden_states=cond["prompt_embeds"][b:b + 1], return_dict=False)[0]
        assert (together[b:b + 1] - alone).abs().max() < ATOL, name
    seen["transformer"].clear(), seen["transformer_2"].clear()
    policy.velocity(x, torch.tensor([0.3, 0.2]), cond)  # one process: only the expert with rows runs
    assert seen["transformer"] == [] and len(seen["transformer_2"]) == 1


def _lora_wrap(policy, seed=0):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    policy.module = get_peft_model(policy.module, LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian",
                                                             target_modules=policy.lora_target_modules))
    return policy.module


@pytest.mark.parametrize("train_experts", ["both", "high"])
def test_lora_per_expert_round_trips_through_load_lora_weights(two_expert_dir, tmp_path, train_experts):
    from difrl.models.lora_io import load_lora, save_lora

    policy = load_flow_policy("wan22", two_expert_dir, train_experts=train_experts, **OPTIONS)
    net = _lora_wrap(policy)
    lora = {n: p.detach().clone() for n, p in net.named_parameters() if "lora_" in n}
    assert {n.split(".")[2] for n in lora} == ({"transformer", "transformer_2"} if train_experts == "both"
                                                else {"transformer"})  # base_model.model.<expert>.
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2)
    assert {id(p) for p in net.parameters() if p.requires_grad} == {id(p) for n, p in net.named_parameters()
                                                                    if "lora_" in n}
    x, cond = sample_noise(SEEDS, 0, tuple(policy.latent_shape)), policy.encode(PROMPTS)
    for _ in range(2):  # rows on both experts (boundary 0.7)
        loss = policy.velocity(x, torch.tensor([0.9, 0.4]), cond, 4.0).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert all(not torch.equal(p, lora[n]) for n, p in net.named_parameters() if "lora_" in n)
    lora_dir = save_lora(policy, tmp_path / "lora")
    low_dir = lora_dir / "transformer_2"
    assert (lora_dir / "pytorch_lora_weights.safetensors").is_file()
    assert (low_dir / "pytorch_lora_weights.safetensors").is_file() == (train_experts == "both")
    sigmas = policy.sigma_schedule(N_STEPS)
    with torch.no_grad():
        trained = policy.decode(rollout(policy, PROMPTS, SEEDS, sigmas, kernel="ode", guidance=4.0).x_final)

    pipe = fresh_pipe(two_expert_dir)  # the user's path: diffusers' own loader, the low expert's with its flag
    pipe.load_lora_weights(str(lora_dir))
    if train_experts == "both":
        pipe.load_lora_weights(str(low_dir), load_into_transformer_2=True)
    latents0 = sample_noise(SEEDS, INIT_STEP, tuple(policy.latent_shape))
    assert (pipe_latents(pipe, latents0, 4.0, output_type="pt") - trained).abs().max() < ATOL
    base = pipe_latents(fresh_pipe(two_expert_dir), latents0, 4.0, output_type="pt")
    assert (base - trained).abs().max() > 1e-4

    for wrap in (False, True):  # into a plain policy (pipe.load_lora_weights) and a peft-wrapped one (resume)
        other = load_flow_policy("wan22", two_expert_dir, train_experts=train_experts, **OPTIONS)
        if wrap:
            _lora_wrap(other, seed=1)
        load_lora(other, lora_dir)
        with torch.no_grad():
            again = other.decode(rollout(other, PROMPTS, SEEDS, sigmas, kernel="ode", guidance=4.0).x_final)
        assert (again - trained).abs().max() < ATOL, wrap


def _train_cfg(path, *overrides):
    from difrl.train.config import load_flow_config

    return load_flow_config(ROOT / "configs" / "wan22_tiny.yaml", [
        f"model.path={path}", "rollout.prompts_per_iter=2", "rollout.group_size=2", "sampler.num_steps=4",
        "eval.num_steps=4", "eval.per_digit=1", "train.iterations=2", "train.micro_batch=auto", "train.grad_accum=2",
        "sampler.guidance=4.0", "model.guidance_scale_2=2.0", "threads=1", *overrides])


@pytest.mark.parametrize("mode", ["lora-both", "full-low"])
def test_two_iterations_train_the_chosen_experts(two_expert_dir, tmp_path, monkeypatch, mode):
    from difrl.models.lora_io import load_transformer
    from difrl.train.flow import trainer as flow
    from difrl.train.flow.trainer import train

    lora = mode.startswith("lora")
    experts = mode.split("-")[1]
    seen = {}
    build = flow.build_world
    monkeypatch.setattr(flow, "build_world", lambda *a, **k: seen.setdefault("world", build(*a, **k)))
    summary = train(_train_cfg(two_expert_dir, f"model.train_experts={experts}",
                               *([] if lora else ["train.lora.enabled=false", "train.lr=1e-3"])), tmp_path / "run")
    run = Path(summary["run_dir"])
    policy = seen["world"].policy
    base = load_flow_policy("wan22", two_expert_dir, **OPTIONS)
    changed = {}
    for name in ("transformer", "transformer_2"):
        before = dict(getattr(base.pipe, name).named_parameters())
        after = {n.replace(".base_layer.", "."): p for n, p in getattr(policy.pipe, name).named_parameters()}
        changed[name] = any(not torch.equal(after[n], p) for n, p in before.items())
        changed[name] |= any("lora_" in n and not torch.equal(p, torch.zeros_like(p)) and "lora_B" in n
                             for n, p in after.items())
    assert changed == {"transformer": experts in ("both", "high"), "transformer_2": experts in ("both", "low")}
    sigmas = policy.sigma_schedule(4)
    with torch.no_grad():
        trained = policy.decode(rollout(policy, PROMPTS, SEEDS, sigmas, kernel="ode", guidance=4.0).x_final)
    if lora:
        assert (run / "lora" / "transformer_2" / "pytorch_lora_weights.safetensors").is_file()
        return
    for name in ("transformer", "transformer_2"):  # each a diffusers checkpoint
        diffusers.WanTransformer3DModel.from_pretrained(str(run / name))
    load_transformer(base, run / "transformer")
    base.guidance_scale_2 = 2.0
    with torch.no_grad():
        again = base.decode(rollout(base, PROMPTS, SEEDS, sigmas, kernel="ode", guidance=4.0).x_final)
    assert (again - trained).abs().max() < ATOL


def test_one_transformer_options_are_refused_on_ti2v(tmp_path):
    from difrl.models.adapters import make_tiny_pipeline

    path = make_tiny_pipeline("wan22", tmp_path / "ti2v")
    with pytest.raises(ValueError, match="guidance_scale_2 and model.train_experts are for Wan 2.2's two-expert"):
        load_flow_policy("wan22", path, train_experts="high", **OPTIONS)
    with pytest.raises(ValueError, match=r"model.train_experts='middle': expected one of both, high, low"):
        load_flow_policy("wan22", path, train_experts="middle", **OPTIONS)


FSDP_SCRIPT = '''
import sys, torch, torch.distributed as dist
from difrl.models.adapters import load_flow_policy
from difrl.train.dist.sharding import FSDPSettings, shard
dist.init_process_group("gloo")
rank = dist.get_rank()
policy = load_flow_policy("wan22", sys.argv[1], height=32, width=32, num_frames=5, max_sequence_length=16)
policy.module = shard(policy.module, policy.block_classes, FSDPSettings(), fp32_inputs=policy.fsdp_fp32_inputs)
x = torch.randn(2, *policy.latent_shape, generator=torch.Generator().manual_seed(rank))
sigma = torch.tensor([[0.9, 0.8], [0.9, 0.3]][rank])  # rank 0: high-noise rows only; rank 1: one row on each expert
with torch.no_grad():  # without gradients: the experts any process needs (all-reduced), rank 0 a stand-in for the low
    v0 = policy.velocity(x, sigma, policy.encode(["a cat", "a dog"]), guidance=4.0)
for _ in range(2):
    policy.velocity(x, sigma, policy.encode(["a cat", "a dog"]), guidance=4.0).pow(2).mean().backward()
grads = {n: p.grad.full_tensor() for n, p in policy.module.named_parameters() if p.grad is not None}
if rank == 0:
    torch.save({"grads": grads, "v0": v0}, sys.argv[2])
dist.destroy_process_group()
'''


@pytest.mark.slow  # a torchrun job of 2 gloo processes, ~20 s
def test_fsdp_two_processes_routing_differently_equal_one_process(two_expert_dir, tmp_path):
    """Under FSDP2 each process's rows may need other experts than another's (here rank 0 only the high-noise one):
    the stand-in forward keeps the processes' gathers and gradient reductions in step (no hang), and the averaged
    gradients equal one unsharded process's over both processes' rows."""
    import os
    import subprocess
    import sys

    script, out = tmp_path / "fsdp_experts.py", tmp_path / "grads.pt"
    script.write_text(FSDP_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script), str(two_expert_dir), str(out)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    saved = torch.load(out)
    sharded = saved["grads"]
    policy = load_flow_policy("wan22", two_expert_dir, **OPTIONS)
    cond = policy.encode(["a cat", "a dog"])
    x0 = torch.randn(2, *policy.latent_shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (saved["v0"] - policy.velocity(x0, torch.tensor([0.9, 0.8]), cond, guidance=4.0)).abs().max() < ATOL
    for _ in range(2):
        for rank, sigma in enumerate(([0.9, 0.8], [0.9, 0.3])):
            x = torch.randn(2, *policy.latent_shape, generator=torch.Generator().manual_seed(rank))
            (policy.velocity(x, torch.tensor(sigma), cond, guidance=4.0).pow(2).mean() / 2).backward()
    grads = {n: p.grad for n, p in policy.module.named_parameters() if p.grad is not None}
    assert grads.keys() == sharded.keys() and any(n.startswith("transformer_2.") for n in grads)
    for n, g in grads.items():  # fp32; the reductions' order differs between 1 and 2 processes
        torch.testing.assert_close(sharded[n], g, rtol=1e-4, atol=1e-6, msg=n)


def test_the_fp8_rollout_copy_holds_and_routes_both_experts(two_expert_dir):
    # the low-precision rollout copy is made of policy.module: both experts quantized by the preset, rows still routed
    from difrl.train.config import load_flow_config
    from difrl.train.flow.trainer import build_rollout_copy
    from difrl.train.precision import MasterWeights

    policy = load_flow_policy("wan22", two_expert_dir, **OPTIONS)
    cfg = load_flow_config(ROOT / "configs" / "wan22_tiny.yaml", [f"model.path={two_expert_dir}",
                                                                   "rollout.precision=fp8_row", "rollout.quant_min_dim=0"])
    copy, _ = build_rollout_copy(cfg, policy, policy.module, MasterWeights(), lambda msg: None)
    quantized = set(copy.report.quantized)
    assert {"transformer.blocks.0.attn1.to_q", "transformer_2.blocks.0.attn1.to_q"} <= quantized
    assert not any("condition_embedder" in n or "proj_out" in n for n in quantized)  # the preset's skips
    x = torch.randn(2, *policy.latent_shape, generator=torch.Generator().manual_seed(0))
    sigma, cond = torch.tensor([0.9, 0.3]), policy.encode(PROMPTS)
    with torch.no_grad():
        v = policy.velocity(x, sigma, cond, 1.0)
        with copy.active(policy):
            v_q = policy.velocity(x, sigma, cond, 1.0)
    for b in range(2):  # each row close to its own expert's exact velocity (fp8 rounding: a few percent)
        err = float((v_q[b] - v[b]).norm() / v[b].norm())
        assert 0 < err < 0.1, (b, err)


def test_difrl_plan_routes_every_row_to_one_expert_and_a_stand_in_to_the_other(two_expert_dir):
    # under difrl plan's FakeTensorMode the timesteps have no values: the forward takes one expert's activations for
    # all rows (the most a micro-batch can put on one expert) plus the other expert's one-row stand-in
    from torch._subclasses.fake_tensor import FakeTensorMode

    policy = load_flow_policy("wan22", two_expert_dir, **OPTIONS)
    rows = {}
    for name in ("transformer", "transformer_2"):
        getattr(policy.pipe, name).register_forward_hook(
            lambda m, a, k, out, name=name: rows.update({name: k["hidden_states"].shape[0]}), with_kwargs=True)
    cond, _ = policy.encode(PROMPTS), policy.negative_cond(2)  # the text encoder runs on real tensors (as in the plan)
    with FakeTensorMode(allow_non_fake_inputs=True):
        v = policy.velocity(torch.zeros(2, *policy.latent_shape), torch.tensor([0.9, 0.3]), cond, guidance=4.0)
    assert v.shape == (2, *policy.latent_shape) and rows == {"transformer": 4, "transformer_2": 1}  # CFG: 2 x 2 rows

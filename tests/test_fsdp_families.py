"""SD3 (SD3.5-Medium's shape), Wan 2.1, SANA, FLUX.2 [dev] and [klein], Z-Image, Qwen-Image, Wan 2.2 TI2V and
Qwen-Image-Edit (tiny diffusers pipelines) under FSDP2 on 2 CPU processes (gloo) equal one unsharded process.

    HF_HUB_OFFLINE=1 python -m pytest tests/test_fsdp_families.py -q           # the launch's tests are slow: one launch, ~2 min

tests/test_fsdp.py does FLUX (and the masked LM); this file gives the other diffusers families the same proof, with
as few launches as the check allows: ONE `accelerate launch --config_file configs/accelerate/fsdp.yaml
--num_processes 2` runs the trainings (each family full fine-tuning and LoRA) one after another through the entry
scripts' own main (tests/many_runs.py: what scripts/train_<kind>.py run), and the one-process references run in this
test process (train(cfg)). Each run is as small as the check allows:
2 prompts x 2 samples (4 per iteration: 1 process accumulates 2 micro-batches of 2 samples, 2 processes take 1 each),
2 denoising steps (1 trained), 3 iterations, the KL to the reference on (full fine-tuning: the frozen copy, sharded
the same way; LoRA: the adapter switched off), SD3, Z-Image and Qwen-Image with CFG (the batched [uncond; cond] forward;
Qwen-Image's norm rescale). Rollouts run in
forward batches of 2 samples (sampler.rollout_batch) so that both runs compute every forward on the same shapes (the
first micro-step's ratio is then exactly 1 in both). Adam's eps = 1 as in tests/test_fsdp.py.

What is compared (rtol 1e-5): every numeric metric of the 3 rows and the evaluation after training, and the trained
weights through the final exported files, transformer/diffusion_pytorch_model.safetensors (full) and
lora/pytorch_lora_weights.safetensors (LoRA): they are gathered once at the end, the same files whatever format the
training checkpoints take under FSDP. transformer/ loads with the diffusers class's from_pretrained, lora/ with the
pipeline's load_lora_weights.

The same launch runs SD3 full fine-tuning with model.dtype=bf16 (fp32 masters gathered in bf16): ratio 1 on the first
micro-step, transformer/ in bf16. Fast, in this process: under FSDP's bf16 the timestep reaches SD3's, Wan's and
SANA's timestep embedding in fp32 (the adapters' fsdp_fp32_inputs; FSDP's input cast alone rounds it).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from difrl.utils.io import load_safetensors_checked
from test_fsdp import ROOT, rows, run

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")

FAMILIES = {  # kind -> (config, diffusers transformer class, pipeline class, block class, extra overrides)
    "sd3": ("sd3_tiny.yaml", "SD3Transformer2DModel", "StableDiffusion3Pipeline", "JointTransformerBlock",
            ["sampler.guidance=4.0"]),  # true CFG: one batched [uncond; cond] forward per step
    "wan": ("wan_tiny.yaml", "WanTransformer3DModel", "WanPipeline", "WanTransformerBlock", []),
    "sana": ("sana_tiny.yaml", "SanaTransformer2DModel", "SanaPipeline", "SanaTransformerBlock", []),
    # FLUX.2: embedded guidance 4 ([dev]), true CFG 4 ([klein] base: [uncond; cond]); one double- and one single-stream
    # block. Their tiny LoRAs get ~10x smaller gradients than SD3's here (B moved ~1e-4 in the 3 iterations): LoRA
    # scale alpha / r = 64 moves B past the 1e-3 check below
    "flux2": ("flux2_tiny.yaml", "Flux2Transformer2DModel", "Flux2Pipeline",
              "Flux2SingleTransformerBlock, Flux2TransformerBlock", ["train.lora.alpha=256"]),
    "flux2_klein": ("flux2_klein_tiny.yaml", "Flux2Transformer2DModel", "Flux2KleinPipeline",
                    "Flux2SingleTransformerBlock, Flux2TransformerBlock", ["sampler.guidance=4.0", "train.lora.alpha=256"]),
    "zimage": ("zimage_tiny.yaml", "ZImageTransformer2DModel", "ZImagePipeline", "ZImageTransformerBlock",
               ["sampler.guidance=4.0"]),  # CFG; 3 blocks: a noise refiner, a context refiner, one main layer
    "qwenimage": ("qwenimage_tiny.yaml", "QwenImageTransformer2DModel", "QwenImagePipeline", "QwenImageTransformerBlock",
                  ["sampler.guidance=4.0"]),  # true CFG with the norm rescale, [uncond; cond] in one forward
    "wan22": ("wan22_tiny.yaml", "WanTransformer3DModel", "WanPipeline", "WanTransformerBlock", []),
    # Qwen-Image-Edit: the source image's latents beside the noisy ones, true CFG with the negative read with the image
    "qwenimage_edit": ("qwenimage_edit_tiny.yaml", "QwenImageTransformer2DModel", "QwenImageEditPipeline",
                       "QwenImageTransformerBlock",
                       ["sampler.guidance=4.0", f"model.prompt_file={ROOT / 'difrl/assets/edit_tiny/prompts.jsonl'}"]),
}
# a family's tiny_pipeline options: SD3 runs SD3.5-Medium's shape (RMS qk-norm, a dual-attention block), which holds
# every module of the plain SD3 one
TINY_OPTIONS = {"sd3": {"variant": "sd3.5-medium"}}
MODES = {"full": ["train.lora.enabled=false"], "lora": []}
SMALL = ["threads=1", "rollout.prompts_per_iter=2", "rollout.group_size=2", "sampler.num_steps=2",
         "sampler.rollout_batch=2", "eval.num_steps=2", "eval.per_digit=1", "train.iterations=3", "train.micro_batch=2",
         "train.lr=1.0", "train.adam_eps=1.0", "train.weight_decay=0", "train.kl_beta=0.1"]
WEIGHTS = {"full": "transformer/diffusion_pytorch_model.safetensors", "lora": "lora/pytorch_lora_weights.safetensors"}


def args(kind: str, mode: str, path: Path) -> list[str]:
    config, *_, extra = FAMILIES[kind]
    return [str(ROOT / "configs" / config), *SMALL, f"model.path={path}", *extra, *MODES[mode]]


@pytest.fixture(scope="module")
def pipes(tmp_path_factory):
    from difrl.models.adapters import make_tiny_pipeline

    root = tmp_path_factory.mktemp("tiny_pipelines")
    return {kind: make_tiny_pipeline(kind, root / kind, seed=0, **TINY_OPTIONS.get(kind, {})) for kind in FAMILIES}


@pytest.fixture(scope="module")
def runs(pipes, tmp_path_factory):
    """{(kind, mode): (one-process run dir, two-process run dir)} and the launch's output. The launch also runs SD3
    full fine-tuning with model.dtype=bf16 (2 iterations, into out["sd3", "bf16"][1]; no one-process twin: bf16)."""
    from difrl.train.flow.trainer import train
    from difrl.train.recipes import load_train_config

    root = tmp_path_factory.mktemp("fsdp_families")
    cases = [(kind, mode) for kind in FAMILIES for mode in MODES]
    out = {c: (root / f"{c[0]}-{c[1]}-one", root / f"{c[0]}-{c[1]}-two") for c in [*cases, ("sd3", "bf16")]}
    # the launches' rollouts gather every block once (rollout.fsdp_gather=auto on CPU processes), Wan's full fine-tune
    # before each forward (FSDP's own schedule): both must equal one process
    per_forward = {("wan", "full"): ["rollout.fsdp_gather=per_forward"]}
    plan = [{"kind": kind, "argv": [*args(kind, mode, pipes[kind]), *per_forward.get((kind, mode), []), "train.grad_accum=1",
                                    "--out", str(out[kind, mode][1])]} for kind, mode in cases]
    plan.append({"kind": "sd3", "argv": [*args("sd3", "full", pipes["sd3"]), "model.dtype=bf16", "train.iterations=2",
                                         "train.grad_accum=1", "--out", str(out["sd3", "bf16"][1])]})
    log = run(2, [str(ROOT / "tests" / "many_runs.py")], [json.dumps(plan)], root / "unused")  # --out: ignored
    for kind, mode in cases:
        config, *overrides = args(kind, mode, pipes[kind])
        train(load_train_config(config, [*overrides, "train.grad_accum=2"]), out[kind, mode][0])
    return out, log


# the first micro-step's max |log ratio| may differ from 0 by float32 rounding (the reductions' order differs between
# CPU types and between 1 and 2 processes); a real train/rollout mismatch is orders of magnitude above this floor
RATIO_FLOOR = 1e-6


def weights(run_dir: Path, mode: str) -> dict[str, torch.Tensor]:
    return load_safetensors_checked(run_dir / WEIGHTS[mode], mode)[0]


@pytest.mark.slow  # shares the module's runs: one 2-process launch (every family's trainings) and the one-process twins, ~5 min
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", list(FAMILIES))
def test_fsdp_equals_one_process(runs, pipes, kind, mode):
    out, log = runs
    one, two = out[kind, mode]
    block = FAMILIES[kind][3]
    units = re.search(rf"difrl: FSDP2 over 2 processes: (\d+) units \((\d+) blocks of {block} \+ the root\)", log)
    assert units and int(units[1]) == int(units[2]) + 1 >= 3, block  # every block a unit, and the root
    ra, rb = rows(one), rows(two)
    assert [r["iteration"] for r in ra] == [r["iteration"] for r in rb] == [1, 2, 3]
    for x, y in zip(ra, rb):
        # ratio 1 on the first on-policy micro-step, to one float32 rounding: 2 FSDP processes gave 5.96e-08 (one ulp
        # of a log-prob near 0.5) on an Intel Xeon with AVX-512 and exactly 0 on AMD EPYC (issue 46, item 11)
        assert x.keys() == y.keys()
        assert max(x["first_step_max_abs_log_ratio"], y["first_step_max_abs_log_ratio"]) <= RATIO_FLOOR, x
        assert x["kl"] > 0 or x["iteration"] == 1, x  # the reference is in the loss (zero before the first update)
        for k, v in x.items():  # the ratio's float noise is checked against its floor above, not against each other
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "first_step_max_abs_log_ratio":
                assert v == pytest.approx(y[k], rel=1e-5, abs=1e-7), (x["iteration"], k)
    ea, eb = (json.loads((d / "summary.json").read_text())["eval_after"] for d in (one, two))
    assert ea.keys() == eb.keys() and ea["reward"] == pytest.approx(eb["reward"], rel=1e-5, abs=1e-7)

    wa, wb = weights(one, mode), weights(two, mode)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-5, atol=1e-7, msg=k)

    _, model_cls, pipe_cls, *_ = FAMILIES[kind]
    if mode == "full":  # transformer/ is a diffusers checkpoint whose weights moved from the base
        base = getattr(diffusers, model_cls).from_pretrained(pipes[kind] / "transformer").state_dict()
        loaded = getattr(diffusers, model_cls).from_pretrained(two / "transformer").state_dict()
        assert loaded.keys() == base.keys() == wb.keys()
        assert max(float((loaded[k] - base[k]).abs().max()) for k in base) > 1e-3
        for k, v in loaded.items():
            torch.testing.assert_close(v, wb[k], rtol=0, atol=0, msg=k)  # exact: the same gathered tensors, saved
    else:  # lora/ loads into a plain pipeline: its tensors are the gathered LoRA weights, B moved from zero
        assert max(float(v.abs().max()) for k, v in wb.items() if "lora_B" in k) > 1e-3
        pipe = getattr(diffusers, pipe_cls).from_pretrained(pipes[kind], local_files_only=True)
        pipe.load_lora_weights(two / "lora")
        state = pipe.transformer.state_dict()
        for k, v in wb.items():  # transformer.X.lora_A.weight -> X.lora_A.default_0.weight
            name = k.removeprefix("transformer.").replace(".lora_A.", ".lora_A.default_0.").replace(".lora_B.", ".lora_B.default_0.")
            torch.testing.assert_close(state[name], v, rtol=0, atol=0, msg=name)  # exact: saved and loaded


@pytest.mark.slow  # the module's launch (shared)
def test_fsdp_bf16_full_finetune_of_sd3(runs, pipes):
    # model.dtype=bf16 full fine-tuning (difrl/train/precision.py): fp32 masters sharded, gathered in bf16 under
    # autocast, the timestep kept fp32 (below): rollout and training compute alike (ratio exactly 1 on the first
    # micro-step) and transformer/ is written in bf16, moved from the base
    out, log = runs
    run_dir = out["sd3", "bf16"][1]
    assert "mixed precision bf16" in log
    assert all(r["first_step_max_abs_log_ratio"] <= RATIO_FLOOR for r in rows(run_dir)), rows(run_dir)
    written = weights(run_dir, "full")
    base = load_safetensors_checked(pipes["sd3"] / WEIGHTS["full"], "base")[0]
    assert written.keys() == base.keys() and {v.dtype for v in written.values()} == {torch.bfloat16}
    assert max(float((written[k].float() - base[k]).abs().max()) for k in base) > 1e-3


def test_the_timestep_reaches_the_embedding_in_fp32_under_fsdp_bf16(pipes):
    # FSDP2's MixedPrecisionPolicy casts every floating input of the root to bf16 (docs/reference/specs/scale.md §2):
    # SD3's and Wan's timestep 1000 sigma would reach the timestep embedding rounded (737.9 -> 736.0) where the pipeline
    # and an unsharded run embed it in fp32. The adapters' fsdp_fp32_inputs keep it
    # (difrl.train.dist.sharding.keep_input_dtypes); the prompt embeddings are still cast. A one-process gloo group in this
    # process.
    import torch.distributed as dist

    from difrl.models.adapters import load_flow_policy
    from difrl.train.dist.sharding import FSDPSettings, shard

    sigma = torch.tensor([0.7379])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        # kind, its timestep embedder, the module whose first input is the prompt's (None: the embedder's second)
        for kind, embedder, text in (("sd3", "time_text_embed", None), ("wan", "condition_embedder", None),
                                     ("sana", "time_embed", "caption_projection"),
                                     ("wan22", "condition_embedder", None)):  # wan22: a timestep per latent token
            for keep in (False, True):
                policy = load_flow_policy(kind, pipes[kind], height=32, width=32, max_sequence_length=16,
                                          **({"num_frames": 5} if kind.startswith("wan") else {}))
                assert policy.fsdp_fp32_inputs == ("timestep",)
                policy.module = shard(policy.module, policy.block_classes, FSDPSettings(mixed_precision="bf16"),
                                      fp32_inputs=policy.fsdp_fp32_inputs if keep else ())
                seen = {}  # the embedder's (timestep, pooled projections | prompt embeddings) as it is called
                getattr(policy.module, embedder).register_forward_pre_hook(
                    lambda m, a, k: seen.update(t=a[0].clone(), **({} if text else {"cond": a[1].dtype})),
                    with_kwargs=True)
                if text:
                    getattr(policy.module, text).register_forward_pre_hook(lambda m, a: seen.update(cond=a[0].dtype))
                x = torch.randn(1, *policy.latent_shape, generator=torch.Generator().manual_seed(0))
                v = policy.velocity(x, sigma, policy.encode(["a red dog"]))
                assert v.shape == x.shape and bool(v.isfinite().all()) and seen["cond"] == torch.bfloat16
                if keep:
                    # exact: the same fp32 product sigma x 1000
                    assert seen["t"].dtype == torch.float32 and torch.equal(seen["t"], (sigma * 1000).expand_as(seen["t"])), (kind, seen["t"])
                else:  # what FSDP's cast alone gives
                    assert seen["t"].dtype == torch.bfloat16 and bool((seen["t"] == 736.0).all()), (kind, seen["t"])
    finally:
        dist.destroy_process_group()


def test_the_launch_rolled_out_with_both_gather_schedules(runs):
    # rollout.fsdp_gather: the equality above holds for rollouts gathered once (auto on CPU processes) and before each
    # forward (Wan's full fine-tune); the trainer says which at start
    _, log = runs
    assert "FSDP rollouts gather every block once per rollout (rollout.fsdp_gather=auto)" in log
    assert "FSDP rollouts gather every block before each forward (rollout.fsdp_gather=per_forward)" in log


def test_zimage_timestep_reaches_the_embedding_in_fp32_under_fsdp_bf16(pipes):
    # as the test above, for Z-Image: its timestep is t = 1 - sigma (kwarg `t`), embedded as t * 1000 in fp32 by the
    # pipeline; FSDP's bf16 cast alone would round 0.2621 to 0.2617 before the embedding
    import torch.distributed as dist

    from difrl.models.adapters import load_flow_policy
    from difrl.train.dist.sharding import FSDPSettings, shard

    sigma = torch.tensor([0.7379])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for keep in (False, True):
            policy = load_flow_policy("zimage", pipes["zimage"], height=32, width=32, max_sequence_length=32)
            assert policy.fsdp_fp32_inputs == ("t",)
            policy.module = shard(policy.module, policy.block_classes, FSDPSettings(mixed_precision="bf16"),
                                  fp32_inputs=policy.fsdp_fp32_inputs if keep else ())
            seen = {}
            policy.module.t_embedder.register_forward_pre_hook(lambda m, a: seen.update(t=a[0].clone()))
            x = torch.randn(1, *policy.latent_shape, generator=torch.Generator().manual_seed(0))
            v = policy.velocity(x, sigma, policy.encode(["a red dog"]), guidance=0.0)
            assert v.shape == x.shape and bool(v.isfinite().all())
            t = (1000 - sigma * 1000) / 1000 * 1000  # the pipeline's (1000 - t) / 1000, times the model's t_scale
            if keep:
                assert seen["t"].dtype == torch.float32 and torch.equal(seen["t"], t), seen["t"]
            else:  # the bf16-rounded t, times 1000 (in bf16)
                assert seen["t"].dtype == torch.bfloat16 and not torch.equal(seen["t"].float(), t), seen["t"]
    finally:
        dist.destroy_process_group()

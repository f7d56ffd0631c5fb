"""The flow trainer on tiny diffusers pipelines (every kind of the adapter table: FLUX.1, SD3, Wan 2.1, Z-Image and the
registered tests/model_plugins.py "example"): the same `train(cfg)` as the digits world.

    HF_HUB_OFFLINE=1 python -m pytest tests/test_train_diffusers.py -q

a. Two iterations with LoRA change every LoRA parameter (an SD3-type MMDiT's structurally dead last-block
   add_q_proj excepted) and no base parameter; the run's diffusers LoRA directory, loaded into a fresh
   pipeline with `load_lora_weights`, gives the trained policy's images. Every kind, the registered one too (4 s);
   every family with a configs/<kind>_tiny.yaml raises its reward beyond the sampling noise in 12 iterations of it
   (c2); the tree rollouts and the 2-process launch stay on FLUX (they test the trainer, not the family; trees and
   Sol-RL from each family's rollout copy: tests/test_family_matrix.py), regional compilation (d, 3 s a kind) on
   the three built-in ones (what it needs of a family, block_classes naming its repeated blocks, tests/test_diffusers_models.py
   checks for every kind).
b. Tiny FLUX trains with BranchGRPO tree rollouts and writes the run directory.
c. `accelerate launch --multi_gpu --num_processes 2 scripts/train_flux.py configs/flux_tiny.yaml` (gloo on
   CPU) runs 2 iterations, writes the run directory and gives the weights one process gives.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")

import model_plugins  # noqa: E402,F401  (tests/ is on sys.path: registers the "example" family)
from difrl.models.adapters import ADAPTERS, BUILTIN_ADAPTERS, load_flow_policy  # noqa: E402
from difrl.models.adapters import make_tiny_pipeline  # noqa: E402
from difrl.rollout import INIT_STEP, rollout, sample_noise  # noqa: E402
from difrl.train.flow import trainer as flow  # noqa: E402
from difrl.train.config import load_flow_config  # noqa: E402
from difrl.train.flow.trainer import TIMING_KEYS, train  # noqa: E402
from difrl.utils.io import load_safetensors_checked  # noqa: E402
from tolerances import FLOW_FIRST_STEP_LOG_RATIO, FP32_REORDER  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "flux_tiny.yaml"
KINDS = list(ADAPTERS)  # the built-in families and every registered one
# FLUX: embedded guidance (one forward); SD3 (and by default a registered family): true CFG (the [uncond; cond]
# forward in rollout and training); Wan: off
GUIDANCE = {"flux": 3.5, "sd3": 4.0, "wan": 1.0, "sana": 4.0, "flux2": 4.0, "flux2_klein": 4.0, "zimage": 4.0, "qwenimage": 4.0, "wan22": 1.0,
            "qwenimage_edit": 4.0}
# how a kind's pipeline takes the guidance (default: guidance_scale=); Qwen-Image: true_cfg_scale with a negative prompt
PIPE_GUIDANCE = {"qwenimage": lambda g: {"true_cfg_scale": g, "negative_prompt": ""},
                 "qwenimage_edit": lambda g: {"true_cfg_scale": g, "negative_prompt": ""}}
# an editing family (source_images) trains on the bundled tiny edit set, its sources resized to 32 x 32
EDIT_SET = ROOT / "difrl" / "assets" / "edit_tiny"
EDIT_OPTIONS = ["model.prompts=null", f"model.prompt_file={EDIT_SET / 'prompts.jsonl'}", "model.source_size=32"]
N_STEPS = 3


def video(kind: str) -> bool:
    return "num_frames" in ADAPTERS[kind].model_options


def edits(kind: str) -> bool:
    return ADAPTERS[kind].source_images


def dead_lora(policy) -> set[str]:
    """An SD3-type MMDiT's last block is context-pre-only: its add_q_proj feeds a discarded output, so its LoRA cannot
    train (tests/test_diffusers_models.py)."""
    n = policy.transformer_config.get("num_layers")
    if type(policy.pipe.transformer).__name__ == "SD3Transformer2DModel":
        return {f"transformer_blocks.{n - 1}.attn.add_q_proj"}
    if type(policy.pipe.transformer).__name__ == "QwenImageTransformer2DModel":  # the last block's text output is unused
        return {f"transformer_blocks.{n - 1}.{t}"  # its text queries feed only text outputs
                for t in ("attn.add_q_proj", "attn.to_add_out", "txt_mlp.net.0.proj", "txt_mlp.net.2")}
    return set()


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_pipelines")
    built = {}

    def get(kind: str) -> Path:
        if kind not in built:
            built[kind] = make_tiny_pipeline(kind, root / kind, seed=0)
        return built[kind]

    return get


# configs/flux_tiny.yaml is the learning run (32 samples x 6 steps, 80 iterations); these tests need only 2 small iterations
SMALL = ["rollout.prompts_per_iter=2", "rollout.group_size=4", "sampler.num_steps=3", "eval.num_steps=3",
         "eval.per_digit=2", "train.iterations=2", "train.micro_batch=4", "train.grad_accum=2"]


def tiny_cfg(kind: str, path: Path, *overrides: str):
    extra = [*SMALL, f"model.kind={kind}", f"model.path={path}", f"sampler.guidance={GUIDANCE.get(kind, 4.0)}"]
    if video(kind):
        extra.append("model.num_frames=5")
    if edits(kind):
        extra += EDIT_OPTIONS
    return load_flow_config(CONFIG, [*extra, "threads=1", *overrides])


def policy_options(cfg) -> dict:
    mc = cfg.model
    return dict(height=mc.height, width=mc.width, max_sequence_length=mc.max_sequence_length,
                **({"num_frames": mc.num_frames} if video(cfg.model.kind) else {}),
                **({"source_size": mc.source_size} if edits(cfg.model.kind) else {}))


def pipe_images(kind: str, pipe, prompts, latents, guidance, cfg) -> torch.Tensor:
    """The pipeline's own call: [B, 3, H, W] (Wan: [B, F, 3, H, W]) in [0, 1]."""
    kw = dict(height=cfg.model.height, width=cfg.model.width, num_inference_steps=N_STEPS, latents=latents.clone(),
              output_type="pt", max_sequence_length=cfg.model.max_sequence_length,
              **PIPE_GUIDANCE.get(kind, lambda g: {"guidance_scale": g})(guidance))
    if video(kind):
        return pipe(prompt=list(prompts), num_frames=cfg.model.num_frames, **kw).frames
    if edits(kind):  # row by row, the source area patched to model.source_size^2 (tests/test_diffusers_models.py)
        from test_diffusers_models import SOURCE_SIZE, edit_pipe_output

        assert cfg.model.source_size == SOURCE_SIZE
        return edit_pipe_output(pipe, prompts, kw)
    # by name: FLUX.2's first argument is an image; a copy: ZImagePipeline rewrites the prompt list in place
    return pipe(prompt=list(prompts), **kw).images


def _record(monkeypatch) -> dict:
    """Capture the trainer's world and the LoRA weights at initialisation (test-side instrumentation only)."""
    seen = {}
    build, wrap = flow.build_world, peft.get_peft_model

    def build_world(*a, **k):
        seen["world"] = build(*a, **k)
        return seen["world"]

    def get_peft_model(*a, **k):
        net = wrap(*a, **k)
        seen["init"] = {n: p.detach().clone() for n, p in net.named_parameters() if "lora_" in n}
        return net

    monkeypatch.setattr(flow, "build_world", build_world)
    monkeypatch.setattr(peft, "get_peft_model", get_peft_model)
    return seen


# ---- a. LoRA training through train(cfg), then the diffusers LoRA directory ------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_two_iterations_train_every_lora_param_and_the_lora_dir_reproduces(kind, tiny_dirs, tmp_path, monkeypatch):
    path = tiny_dirs(kind)
    cfg = tiny_cfg(kind, path)
    seen = _record(monkeypatch)
    summary = train(cfg, tmp_path / "run")
    run = Path(summary["run_dir"])
    assert summary["iterations"] == 2 and len((run / "metrics.jsonl").read_text().splitlines()) == 2
    policy = seen["world"].policy
    net = policy.module
    # the summary's evaluations are the world's fixed-seed evaluation of the trained policy (after) and of the base
    # (before: the LoRA disabled), recomputed here
    world, ev = seen["world"], (cfg.eval.per_digit, cfg.eval.num_steps, cfg.eval.seed, cfg.sampler.shift)
    # recomputed outside the trainer (its batches may be cut apart): fp32 reordering of a mean reward in [0, 1]
    assert world.evaluate(policy, *ev)[0]["reward"] == pytest.approx(summary["eval_after"]["reward"], abs=1e-6)
    with net.disable_adapter():
        assert world.evaluate(policy, *ev)[0]["reward"] == pytest.approx(summary["eval_before"]["reward"], abs=1e-6)
    after = {n: p.detach() for n, p in net.named_parameters()}
    unchanged = {n.split(".lora_")[0].removeprefix("base_model.model.") for n, v in seen["init"].items()
                 if torch.equal(after[n], v)}
    assert unchanged == dead_lora(policy), unchanged
    fresh = load_flow_policy(kind, path, **policy_options(cfg))
    base = dict(fresh.module.named_parameters())
    for n, p in after.items():
        if "lora_" not in n:
            name = n.removeprefix("base_model.model.").replace(".base_layer.", ".")
            assert torch.equal(p, base[name]), f"base parameter {name} changed"

    # the saved diffusers LoRA dir in a fresh pipeline == the trained policy, same seeds and sigmas
    lora_dir = run / "lora"
    assert (lora_dir / "pytorch_lora_weights.safetensors").is_file()
    prompts, seeds = world.prompts[:2], torch.tensor([5, 6])  # an editing family's carry their source images
    sigmas = policy.sigma_schedule(N_STEPS)
    with torch.no_grad():
        trained = policy.decode(rollout(policy, prompts, seeds, sigmas, kernel="ode", guidance=cfg.sampler.guidance).x_final)
    pipe = getattr(diffusers, ADAPTERS[kind].pipeline_class).from_pretrained(str(path), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    latents0 = sample_noise(seeds, INIT_STEP, tuple(policy.latent_shape))
    base_images = pipe_images(kind, pipe, prompts, latents0, cfg.sampler.guidance, cfg)
    pipe.load_lora_weights(str(lora_dir))
    images = pipe_images(kind, pipe, prompts, latents0, cfg.sampler.guidance, cfg)
    assert (images - trained).abs().max() < 1e-5  # the pipeline's own loop vs our sampler: fp32 reordering, [0, 1]
    assert (base_images - trained).abs().max() > 1e-5, float((base_images - trained).abs().max())  # the LoRA shows
    grid = run / "samples" / ("after-iter-000002.gif" if video(kind) else "after-iter-000002.png")
    assert grid.is_file()


# ---- b. tree rollouts ---------------------------------------------------------------------------------

def test_flux_trains_with_tree_rollouts(tiny_dirs, tmp_path):
    cfg = tiny_cfg("flux", tiny_dirs("flux"), "rollout.kind=tree", "tree.split_steps=[0,1]", "rollout.group_size=4")
    summary = train(cfg, tmp_path / "tree")
    run = Path(summary["run_dir"])
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["tree/edges_trained"] > 0 for r in rows)
    assert all(r["first_step_max_abs_log_ratio"] < FLOW_FIRST_STEP_LOG_RATIO for r in rows)  # fp32 recompute
    for name in ("config.yaml", "summary.json", "reward_curve.png", "lora/pytorch_lora_weights.safetensors",
                 "samples/before-iter-000000.png", "samples/after-iter-000002.png", "checkpoints/latest"):
        assert (run / name).is_file(), name


# ---- c. accelerate launch, 2 processes == 1 -------------------------------------------------------------

# one optimizer update per rollout (8 samples: 1 x 4 micro-batches of 2 samples x 2 steps == 2 x 2), so both see the
# same samples in each update; Adam with adam_eps = 1 makes the update proportional to the gradient (as test_distributed.py)
COMMON = ["train.micro_batch=4", "train.adam_eps=1.0", "train.lr=1.0", "train.weight_decay=0", "threads=1"]


def _launch(out: Path, nproc: int, path: Path, grad_accum: int) -> None:
    """scripts/train_flux.py on one process (in this one: tests/test_fsdp.py's run_here, without a second start-up
    of torch and diffusers) or `accelerate launch --multi_gpu` of `nproc`."""
    args = [str(CONFIG), f"model.path={path}", *SMALL, *COMMON, f"train.grad_accum={grad_accum}"]
    if nproc == 1:
        from test_fsdp import run_here

        run_here([str(ROOT / "scripts" / "train_flux.py")], args, out)
        return
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    script = [str(ROOT / "scripts" / "train_flux.py"), *args, "--out", str(out)]
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(nproc),
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", "0", *script]  # 0: a free port (the default, 29500, may be another test's, tests/conftest.py)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"{nproc} process(es)" in proc.stdout + proc.stderr


@pytest.mark.slow  # end to end, several seconds: left out by `make test-fast`
def test_accelerate_launch_two_processes_equal_one(tiny_dirs, tmp_path):
    path = tiny_dirs("flux")
    one, two = tmp_path / "one", tmp_path / "two"
    _launch(one, 1, path, grad_accum=4)
    _launch(two, 2, path, grad_accum=2)
    for run in (one, two):
        for name in ("config.yaml", "summary.json", "metrics.jsonl", "lora/pytorch_lora_weights.safetensors"):
            assert (run / name).is_file(), (run, name)
    rows = lambda d: [{k: v for k, v in json.loads(ln).items() if k not in TIMING_KEYS}
                      for ln in (d / "metrics.jsonl").read_text().splitlines()]
    r1, r2 = rows(one), rows(two)
    assert len(r1) == len(r2) == 2
    for a, b in zip(r1, r2):
        for k in ("reward_mean", "reward_std", "adv_mean", "adv_std", "trained_samples"):
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k  # the same samples, gathered rewards
        for k in ("loss", "approx_kl", "grad_norm"):
            assert a[k] == pytest.approx(b[k], rel=1e-3, abs=1e-7), k  # means over processes: summation order
    ckpt = lambda d: load_safetensors_checked(d / "checkpoints" / "iter-000002" / "trainable.safetensors", "weights")[0]
    w1, w2 = ckpt(one), ckpt(two)
    assert w1.keys() == w2.keys() and w1
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], rtol=1e-3, atol=1e-6, msg=k)  # fp32 sums in another order
    assert any(float(w.abs().max()) > 1e-4 for k, w in w1.items() if "lora_B" in k)  # training moved B
    # the evaluation before training, its samples split over the 2 processes and gathered, is one process's: the same
    # seeds and weights, rollout batches of half the size (float summation order only: 1e-4 relative)
    e1, e2 = (json.loads((d / "summary.json").read_text())["eval_before"] for d in (one, two))
    assert e1.keys() == e2.keys() and e1["samples"] == e2["samples"]
    for k, v in e1.items():
        assert v == (pytest.approx(e2[k], rel=1e-4, abs=1e-6) if isinstance(v, float) else e2[k]), k


# ---- c2. each family's tiny config learns (benchmarks/bench_models.py measures them over seeds) ---------------

# every family that ships configs/<kind>_tiny.yaml (a new family adds its own: then this checks it learns too)
LEARNING_KINDS = [k for k in KINDS if (ROOT / "configs" / f"{k}_tiny.yaml").is_file()]
# iterations of the config's 80 that show learning; measured on the 2-core CI machine, seed 0 (delta / noise; seconds):
# flux 12: +0.0039 / 0.0012 (3.2x; 8 s), sd3 12: +0.0069 / 0.0010 (6.7x; 8 s; at 8 no gain yet, at 10 4.5x),
# wan 12: +0.0086 / 0.0022 (3.9x; 11 s; at 10 3.2x). A family that needs more states its own number here.
# qwenimage: +0.0021 at 12 (below 2x its noise), 2.4x at 40, 60: +0.0034 / 0.00085 (3.9x; seed 0, this session's
# shared machine): its tiny red reward moves slowly (0.030 -> 0.034)
# qwenimage_edit (the bundled tiny edit set): -0.0007 at 12, 40: +0.0023 / 0.00095 (2.4x), 80: +0.0030 / 0.00086 (3.4x)
LEARN_ITERATIONS: dict[str, int] = {"qwenimage": 60, "qwenimage_edit": 60}


@pytest.mark.slow  # 12 iterations of 32 samples: several seconds a family
@pytest.mark.parametrize("kind", LEARNING_KINDS)
def test_tiny_config_raises_its_reward_beyond_the_sampling_noise(kind, tiny_dirs, tmp_path):
    iterations = LEARN_ITERATIONS.get(kind, 12)
    cfg = load_flow_config(ROOT / "configs" / f"{kind}_tiny.yaml",
                           [f"model.path={tiny_dirs(kind)}", f"train.iterations={iterations}", "threads=1",
                            *([f"model.prompt_file={EDIT_SET / 'prompts.jsonl'}"] if edits(kind) else [])])
    assert cfg.model.kind == kind
    summary = train(cfg, tmp_path / "learn")
    change = summary["reward_change"]
    assert change["before"] == summary["eval_before"]["reward"] and change["after"] == summary["eval_after"]["reward"]
    # beyond twice the sampling noise (the standard error of after - before, conservative: the two evaluations
    # share their seeds); the measured margins are above
    assert change["noise"] > 0 and change["delta"] > 2 * change["noise"], change
    saved = json.loads((Path(summary["run_dir"]) / "summary.json").read_text())
    assert saved["reward_change"] == change  # exact: JSON writes a float's shortest repr, which reads back the same


def test_change_over_noise_values():
    from difrl.eval.metrics import change_over_noise

    ch = change_over_noise({"reward": 0.5, "reward_sem": 0.03}, {"reward": 0.7, "reward_sem": 0.04})
    # float64 arithmetic on decimal literals (0.7 - 0.5 is not 0.2 in binary): a few ulp
    assert ch["delta"] == pytest.approx(0.2, rel=1e-12) and ch["noise"] == pytest.approx(0.05, rel=1e-12)
    assert ch["delta_over_noise"] == pytest.approx(4.0, rel=1e-12)
    assert change_over_noise({"reward": 0.5}, {"reward": 0.7, "reward_sem": 0.04}) is None  # a world without a sem
    assert change_over_noise({"reward": 0.5, "reward_sem": 0.0}, {"reward": 0.5, "reward_sem": 0.0})["delta_over_noise"] is None


# ---- d. the pieces: checkpoint-free rewards, config checks, the script's kind check ----------------------

def test_simple_rewards_score_images_and_videos():
    from difrl.rewards import build_reward

    img = torch.zeros(2, 3, 4, 4)
    img[0, 0] = 1.0  # all red
    img[1] = 0.5
    # fp32 means of pixels against float64 fractions: reordered sums
    assert torch.allclose(build_reward("brightness")(img, ["a", "b"], [])["brightness"], torch.tensor([1 / 3, 0.5]),
                          **FP32_REORDER)
    assert torch.allclose(build_reward("brightness", target=0.5)(img, ["a", "b"], [])["brightness"],
                          torch.tensor([1 - 1 / 6, 1.0]), **FP32_REORDER)
    assert torch.allclose(build_reward("color", channel="red")(img, ["a", "b"], [])["color"], torch.tensor([1.0, 0.0]),
                          **FP32_REORDER)
    video = img[:, None].expand(2, 5, 3, 4, 4)  # [B, F, C, H, W]: per clip
    assert torch.allclose(build_reward("color")(video, ["a", "b"], [])["color"], torch.tensor([1.0, 0.0]),
                          **FP32_REORDER)
    with pytest.raises(ValueError, match="channel must be one of"):
        build_reward("color", channel="pink")


def test_config_checks_for_diffusers_models(tmp_path):
    from difrl.config import ConfigError

    with pytest.raises(ConfigError, match="model.prompts"):
        load_flow_config(CONFIG, ["model.prompts=null"])
    with pytest.raises(ConfigError, match="stop.fd_rise"):
        load_flow_config(CONFIG, ["stop.fd_rise=1.2"])
    with pytest.raises(ConfigError, match="sampler.shift"):
        load_flow_config(CONFIG, ["sampler.shift=3.0"])
    assert load_flow_config(CONFIG, ["sampler.shift=3.0", "model.schedule=shift"]).sampler.shift == 3.0


def test_gradient_checkpointing_changes_memory_not_the_run(tiny_dirs, tmp_path, monkeypatch):
    # model.gradient_checkpointing recomputes block activations in the backward: same losses, gradients and weights
    path = tiny_dirs("sd3")
    seen = _record(monkeypatch)
    runs = {}
    for flag in ("false", "true"):
        cfg = tiny_cfg("sd3", path, "train.iterations=1", "eval.every=0", f"model.gradient_checkpointing={flag}")
        train(cfg, out_dir=tmp_path / flag)
        runs[flag] = tmp_path / flag
        assert seen["world"].policy.pipe.transformer.gradient_checkpointing == (flag == "true")
    rows = {f: json.loads((d / "metrics.jsonl").read_text().splitlines()[0]) for f, d in runs.items()}
    for k in ("policy_loss", "grad_norm", "first_step_max_abs_log_ratio", "reward_mean"):
        # the recomputed activations are the same ops; the backward may add gradient terms in another order
        assert rows["true"][k] == pytest.approx(rows["false"][k], rel=1e-6, abs=1e-9), k
    w = {f: load_safetensors_checked(d / "checkpoints" / "iter-000001" / "trainable.safetensors", "weights")[0]
         for f, d in runs.items()}
    for k in w["false"]:
        torch.testing.assert_close(w["true"][k], w["false"][k], rtol=1e-6, atol=1e-7, msg=k)


@pytest.mark.parametrize("kind", list(BUILTIN_ADAPTERS))
def test_compile_blocks_compiles_every_repeated_block_and_keeps_the_velocity(kind, tiny_dirs):
    # regional compilation (model.compile): each repeated transformer block is torch.compile'd; the "eager" backend
    # checks the wiring here without paying for inductor (bench_gpu.py measures inductor on a GPU)
    cfg = tiny_cfg(kind, tiny_dirs(kind))
    policy = load_flow_policy(kind, tiny_dirs(kind), **policy_options(cfg))
    x = torch.randn(2, *policy.latent_shape, generator=torch.Generator().manual_seed(0))
    prompts = ["a photo of a cat", "a red dog"]
    if edits(kind):
        from difrl.worlds.diffusers import read_prompts

        prompts = read_prompts(cfg.model, sources=True)[0][:2]  # the edit set's, with their source images
    sigma, cond = torch.full((2,), 0.7), policy.encode(prompts)
    with torch.no_grad():
        before = policy.velocity(x, sigma, cond)
    blocks = [m for m in policy.pipe.transformer.modules() if type(m).__name__ in policy.block_classes]
    assert policy.compile_blocks(backend="eager") == len(blocks) > 0
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in blocks)
    with torch.no_grad():
        torch.testing.assert_close(policy.velocity(x, sigma, cond), before, rtol=1e-5, atol=1e-6)  # FP32_REORDER's
        # reason: a compiled block may fuse and reorder its ops


def test_memory_options_are_for_diffusers_models_only(tiny_dirs):
    from difrl.config import ConfigError
    from difrl.worlds import build_world

    for key in ("gradient_checkpointing", "compile"):
        with pytest.raises(ConfigError, match=f"model.{key}.*diffusers transformers"):
            load_flow_config(ROOT / "configs" / "digits.yaml", [f"model.{key}=true"])
    cfg = tiny_cfg("flux", tiny_dirs("flux"), "model.compile=true", "model.gradient_checkpointing=true")
    transformer = build_world("flux", cfg.model.path, cfg).policy.pipe.transformer
    blocks = [m for m in transformer.modules() if type(m).__name__ in ("FluxTransformerBlock", "FluxSingleTransformerBlock")]
    assert blocks and all(getattr(b, "_compiled_call_impl", None) is not None for b in blocks)
    assert transformer.gradient_checkpointing


def test_entry_script_refuses_another_kind(tmp_path, capsys):
    from difrl.train.entry import main

    assert main("sd3", [str(CONFIG), f"model.path={tmp_path}", "--out", str(tmp_path / "run")]) == 2
    assert "model.kind=flux config; this script trains sd3" in capsys.readouterr().err


@pytest.mark.slow  # two short training runs in subprocesses
def test_bench_models_quick_rows_and_reuse(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_models", ROOT / "benchmarks" / "bench_models.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    argv = ["--quick", "--kinds", "flux", "--out", str(tmp_path), "--json", str(tmp_path / "rows.json")]
    rows = bench.main(argv)
    runs = [r for r in rows if not r.get("summary")]  # then one summary row per family (the block's derived figures)
    assert [(r["kind"], r["seed"], r["processes"], r["iterations"]) for r in runs] == [("flux", 0, 1, 12)]
    assert [(r["kind"], r["seeds"]) for r in rows if r.get("summary")] == [("flux", 1)]
    r = rows[0]
    assert r["delta"] == r["after"] - r["before"] and r["noise"] > 0 and r["peak_rss_mib"] > 100  # the same subtraction
    summary = json.loads((tmp_path / "flux-s0" / "summary.json").read_text())
    assert summary["reward_change"]["after"] == r["after"]
    assert json.loads((tmp_path / "rows.json").read_text()) == rows
    assert "one seed gives no spread, so no claim" in capsys.readouterr().out  # --quick: one seed, never a claim
    assert bench.main([*argv, "--reuse"]) == rows  # the finished run's row, not a new run
    # the sentences come from the rows: every seed above 3x the noise -> a claim; a seed below it -> none
    one = [dict(r, seed=s, delta=d) for s, d in enumerate([0.02, 0.03, 0.025])]
    assert "raised the reward in every seed" in bench.verdict("flux", one, None)
    assert "no clear gain" in bench.verdict("flux", [*one[:2], dict(r, seed=2, delta=0.5 * r["noise"])], None)

"""The flow trainer on video: the bundled moving-digits world end to end, and a tiny Wan 2.1 pipeline with
BranchGRPO tree rollouts and Sol-RL.

    HF_HUB_OFFLINE=1 .venv/bin/python -m pytest tests/test_train_video.py -q

a. A moving-digits run writes the image world's artifacts, with GIF grids (before, each eval, after) in samples/.
b. The first micro-step of every update method is on policy (ratio 1) on video latents [B, 8, 256]; BranchGRPO,
   GRPO-Guard, a corrector over a low-precision rollout copy and Sol-RL run on the world unchanged.
c. Resume continues exactly on the video world.
d. Tiny Wan trains with rollout.kind=tree and rollout.kind=solrl and writes GIFs of its samples.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from difrl.models.video_flow import BUNDLED_BASE, MovingDigitsPolicy
from difrl.rollout import recompute, rollout
from difrl.samplers.schedules import sigma_schedule
from difrl.train.config import load_flow_config
from difrl.train.flow.trainer import TIMING_KEYS, train
from difrl.utils.io import load_safetensors_checked
from difrl.worlds.moving_digits import PROMPTS
from tolerances import FLOW_FIRST_STEP_LOG_RATIO

# 8 clips per iteration (2 prompts x 4), 3 steps, 2 optimizer updates per rollout, a 40-clip evaluation.
# model.path / model.prompts: what the bundled world uses anyway (the flow config asks every world but digits)
TINY = [
    "model.kind=moving_digits", f"model.path={BUNDLED_BASE}", f"model.prompts={json.dumps(PROMPTS[:8])}",
    "reward.weights={frame_digit: 1.0, motion_direction: 1.0, digit_consistency: 0.5}",
    "seed=3", "threads=1", "sampler.num_steps=3", "rollout.prompts_per_iter=2", "rollout.group_size=4",
    "train.micro_batch=4", "train.grad_accum=2", "train.iterations=1", "train.lr=1e-3",
    "train.clip_low=1e-3", "train.clip_high=1e-3", "eval.every=0", "eval.per_digit=1", "eval.num_steps=2",
]


def run(out: Path, *overrides: str) -> tuple[dict, Path]:
    return train(load_flow_config(None, [*TINY, *overrides]), out_dir=out), out


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def gif_frame_count(path: Path) -> int:
    from PIL import Image

    with Image.open(path) as im:
        return im.n_frames


# ------------------------------------------------------------------------- a. artifacts


@pytest.mark.slow  # 2 iterations and 4 evaluations of the video world: several seconds
def test_video_world_run_writes_artifacts_and_gifs(tmp_path):
    summary, d = run(tmp_path / "r", "train.iterations=2", "eval.every=1")
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "eval.json", "reward_curve.png", "report.html",
                 "policy.safetensors", "checkpoints/latest"):
        assert (d / name).is_file(), name
    gifs = sorted(p.name for p in (d / "samples").iterdir())
    assert gifs == ["after-iter-000002.gif", "before-iter-000000.gif", "eval-iter-000001.gif"]
    assert all(gif_frame_count(d / "samples" / g) == 8 for g in gifs)  # the clips move: no frame merged away
    assert "before-iter-000000.gif" in (d / "report.html").read_text()
    saved = json.loads((d / "summary.json").read_text())
    for key in ("accuracy", "motion_accuracy", "judge_accuracy", "judge_motion_accuracy", "fd", "diversity"):
        assert isinstance(saved["eval_after"][key], float), key
    assert saved["headline"] == ["accuracy", "motion_accuracy", "fd"]
    r = rows(d)
    assert [x["iteration"] for x in r] == [1, 2] and "eval/motion_accuracy" in r[0]
    for key in ("frame_digit", "motion_direction", "digit_consistency"):  # each reward logged by name
        assert f"reward/{key}_mean" in r[0] or any(k.startswith(f"reward/{key}") for k in r[0]), (key, sorted(r[0]))
    # the trained policy is a plain moving-digits checkpoint (model.path takes it) and it moved
    trained = MovingDigitsPolicy.from_checkpoint(d / "policy.safetensors")
    base = MovingDigitsPolicy.from_checkpoint()
    assert not torch.equal(trained.net.x_out.weight, base.net.x_out.weight)


# ------------------------------------------------------------------------- b. ratio 1, every method


def test_first_micro_step_ratio_is_one_on_video_latents():
    """Direct: a flow-SDE rollout of the video policy, recomputed under the same weights, has log-ratio 0."""
    policy = MovingDigitsPolicy.from_checkpoint()
    n = 4
    batch = rollout(policy, PROMPTS[:4], torch.arange(4), sigma_schedule(n), kernel="flow_sde",
                    kernel_kwargs={"noise_level": 0.7}, sde_mask=torch.ones(n, dtype=torch.bool),
                    train_mask=torch.ones(n, dtype=torch.bool).index_fill(0, torch.tensor([n - 1]), False))
    assert batch.x.shape == (4, 3, 8, 256) and batch.x_final.shape == (4, 8, 256)
    out = recompute(policy, batch, "flow_sde", {"noise_level": 0.7})
    assert float((out.log_prob - batch.log_prob_old).abs().max()) <= FLOW_FIRST_STEP_LOG_RATIO  # one forward vs steps


@pytest.mark.parametrize("overrides", [
    (),
    ("rollout.kind=tree", "tree.split_steps=[0,1]"),
    ("train.ratio_norm=true", "train.step_weight=inverse_dt"),
    ("rollout.precision=fp8", "correct.method=token_tis"),
    ("rollout.kind=solrl", "rollout.precision=nvfp4", "solrl.candidates=8", "solrl.preview_steps=2"),
    ("rollout.kind=solrl", "rollout.precision=nvfp4", "solrl.candidates=8", "solrl.preview_steps=2",
     "train.objective=nft", "train.clip_low=1e-4", "train.clip_high=1e-4"),
], ids=["flow_grpo", "branchgrpo", "grpo_guard", "fp8_copy_tis", "solrl_grpo", "solrl_nft"])
def test_every_method_runs_on_the_video_world(tmp_path, overrides):
    _, d = run(tmp_path / "r", *overrides)
    row = rows(d)[0]
    if "train.objective=nft" not in overrides:  # GRPO: the ratio check passed and is exact here
        assert row["first_step_max_abs_log_ratio"] <= FLOW_FIRST_STEP_LOG_RATIO
    if "rollout.kind=tree" in overrides:
        assert row["tree/edges_trained"] > 0
    if "rollout.kind=solrl" in overrides:
        assert row["nfe_lowprec"] == 2 * 8 * 2  # 2 prompts x 8 candidates x 2 preview steps
    if "correct.method=token_tis" in overrides:
        assert row["correct/kl_k3"] > 0.0  # the fp8 copy is a different policy
    assert row["trained_samples"] > 0 and (d / "samples" / "after-iter-000001.gif").is_file()


# ------------------------------------------------------------------------- c. resume


def test_resume_continues_exactly_on_the_video_world(tmp_path):
    extra = ("steps.mode=random_window", "steps.window_size=1", "train.ema_decay=0.7", "train.kl_beta=0.1",
             "eval.every=3")  # the evaluation at iteration 3 falls after the resume boundary (2)
    _, full = run(tmp_path / "full", *extra, "train.iterations=4")
    _, part = run(tmp_path / "part", *extra, "train.iterations=2")
    train(load_flow_config(None, [*TINY, *extra, "train.iterations=4", f"resume={part}"]))
    strip = lambda rs: [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rs]  # noqa: E731
    assert strip(rows(full)) == strip(rows(part))
    for name in ("policy.safetensors",):
        a, b = (load_safetensors_checked(d / name, "test")[0] for d in (full, part))
        assert all(torch.equal(a[k], b[k]) for k in a)  # exact: a resume replays the same ops on the same inputs
    sf, sp = (json.loads((d / "summary.json").read_text()) for d in (full, part))
    assert sf["eval_after"] == sp["eval_after"]


# ------------------------------------------------------------------------- d. tiny Wan: trees and Sol-RL


@pytest.fixture(scope="module")
def tiny_wan(tmp_path_factory):
    pytest.importorskip("diffusers")
    pytest.importorskip("peft")
    from difrl.models.adapters import make_tiny_pipeline

    return make_tiny_pipeline("wan", tmp_path_factory.mktemp("tiny_wan") / "wan", seed=0)


def wan_cfg(path: Path, *overrides: str):
    """A tiny Wan run, every setting here (not read from a shared YAML): 2 prompts x 4 clips of 5 frames at
    32x32, 3 steps, brightness reward, 2 iterations."""
    return load_flow_config(None, [
        "model.kind=wan", f"model.path={path}", "model.num_frames=5", "model.height=32", "model.width=32",
        "model.max_sequence_length=16", 'model.prompts=["a photo of a cat", "a red dog", "a bright sky"]',
        "reward.weights={brightness: 1.0}", "sampler.guidance=1.0", "sampler.num_steps=3", "sampler.noise_level=0.9",
        "seed=0", "threads=1", "train.iterations=2", "rollout.prompts_per_iter=2", "rollout.group_size=4",
        "train.micro_batch=4", "train.grad_accum=2", "train.lora.rank=4", "train.lora.alpha=8", "eval.every=0",
        "eval.per_digit=2", "eval.num_steps=3", *overrides])


@pytest.mark.slow  # two tiny-Wan runs: several seconds each
@pytest.mark.parametrize("overrides", [
    ("rollout.kind=tree", "tree.split_steps=[0,1]"),
    ("rollout.kind=solrl", "rollout.precision=nvfp4", "solrl.candidates=6", "solrl.preview_steps=2"),
], ids=["tree", "solrl"])
def test_tiny_wan_trains_with_trees_and_solrl_and_writes_gifs(tiny_wan, tmp_path, overrides):
    summary = train(wan_cfg(tiny_wan, *overrides), tmp_path / "wan")
    d = Path(summary["run_dir"])
    r = rows(d)
    assert len(r) == 2 and all(x["first_step_max_abs_log_ratio"] <= FLOW_FIRST_STEP_LOG_RATIO for x in r)
    if "rollout.kind=tree" in overrides:
        assert all(x["tree/edges_trained"] > 0 for x in r)
    else:
        assert all(x["nfe_lowprec"] == 2 * 6 * 2 for x in r)  # 2 prompts x 6 candidates x 2 preview steps
    assert (d / "lora" / "pytorch_lora_weights.safetensors").is_file()
    for name in ("before-iter-000000.gif", "after-iter-000002.gif"):
        assert gif_frame_count(d / "samples" / name) >= 2, name  # an animated clip grid (5 frames; identical ones merge)


# ------------------------------------------------------------------------- benchmarks/bench_video.py


def _bench_video():
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_video.py"
    spec = importlib.util.spec_from_file_location("bench_video", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.slow  # seven 1-iteration runs of the video world (the cheaper ones resumed to flat GRPO's budget)
def test_bench_video_rows(tmp_path):
    rows = _bench_video().main(["--quick", "--iterations", "1", "--every", "1", "--out", str(tmp_path), "--json",
                                str(tmp_path / "rows.json")])
    by = {r["method"]: r for r in rows}
    assert list(by) == ["flat GRPO", "flat GRPO + TempFlow", "flat GRPO, steps 0-3", "BranchGRPO",
                        "BranchGRPO, leaf weights + TempFlow", "BranchGRPO forest, steps 0-3", "Sol-RL"]
    assert by["flat GRPO"]["iterations_run"] == [1]  # the budget's method is never resumed
    assert all(min(r["iterations_run"]) >= 1 for r in rows)
    # NFE per iteration, 4 prompts x 16 clips, 8 steps: flat samples 512 and trains 7 steps of each;
    # TempFlow only reweights them; steps 0-3 trains 4 steps of each; Sol-RL adds 4 x 32 candidates x 4 preview
    # steps; a 16-leaf tree samples fewer than 16 paths
    assert by["flat GRPO"]["nfe_per_iter"] == by["flat GRPO + TempFlow"]["nfe_per_iter"] == 64 * 8 + 64 * 7
    assert by["flat GRPO, steps 0-3"]["nfe_per_iter"] == 64 * 8 + 64 * 4
    assert by["Sol-RL"]["nfe_per_iter"] == 64 * 8 + 64 * 7 + 4 * 32 * 4
    assert by["BranchGRPO"]["nfe_ratio"] != 1.0
    for r in rows:  # the ratios are to flat GRPO's row of the same run
        # float64: the same division of the same counts
        assert r["nfe_ratio"] == pytest.approx(r["nfe_per_iter"] / by["flat GRPO"]["nfe_per_iter"], rel=1e-12)
    assert json.loads((tmp_path / "rows.json").read_text())[0]["method"] == "flat GRPO"


def test_bench_video_reads_each_run_at_its_last_evaluation_inside_the_budget():
    bench = _bench_video()
    ev = lambda a: {k: a for k in bench.METRICS}  # noqa: E731
    # (cumulative training seconds, iteration, metrics): synthetic numbers, no clock involved
    run = {"evals": [(0.0, 0, ev(0.1)), (10.0, 10, ev(0.2)), (20.0, 20, ev(0.3)), (31.0, 30, ev(0.4))]}
    assert bench.at_budget(run, 25.0) == {"seconds": 20.0, "iteration": 20, **ev(0.3)}
    assert bench.at_budget(run, 20.0)["iteration"] == 20  # an evaluation exactly at the budget counts
    assert bench.at_budget(run, 5.0)["iteration"] == 0    # before the first evaluation: the base

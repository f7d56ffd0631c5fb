"""The evaluation panel of a diffusers world: held-out rewards and FD / KID, recorded in eval.json.

    HF_HUB_OFFLINE=1 .venv/bin/python -m pytest tests/test_eval_panel.py -q

A tiny FLUX run trained on brightness, evaluated before and after with a held-out panel (HPSv2 and
CLIP score on tiny backbones in their real file layouts) and FID / KID on a tiny random-weight
Inception saved to a local file, against a directory of reference PNGs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("open_clip")
pytest.importorskip("torch_fidelity")

ROOT = Path(__file__).resolve().parent.parent
# configs/flux_tiny.yaml is a learning run (colour reward, 32 samples x 6 steps); these tests want a small brightness run
SMALL = ["rollout.prompts_per_iter=2", "rollout.group_size=4", "sampler.num_steps=3", "eval.num_steps=3",
         "eval.per_digit=2", "train.micro_batch=4", "train.grad_accum=2", "reward.weights={brightness: 1.0}",
         "reward.options={}"]


@pytest.mark.slow  # end to end, several seconds: left out by `make test-fast`
def test_tiny_flux_eval_json_holds_fid_kid_and_the_heldout_panel(tmp_path):
    from PIL import Image

    from difrl.eval.fid import save_random_inception_weights
    from difrl.models.tiny import make_tiny_pipeline
    from difrl.rewards.tiny import tiny_reward_options
    from difrl.train.config import load_flow_config
    from difrl.train.flow import train

    tiny = tiny_reward_options(tmp_path / "rewards")
    inception = save_random_inception_weights(tmp_path / "inception.pth", seed=0)
    ref = tmp_path / "reference"
    ref.mkdir()
    g = torch.Generator().manual_seed(0)
    for i in range(6):  # 48 x 48: resized to the samples' 32 x 32 on the way in
        px = (torch.rand(48, 48, 3, generator=g) * 255).to(torch.uint8).numpy()
        Image.fromarray(px).save(ref / f"{i:02d}.png")
    path = make_tiny_pipeline("flux", tmp_path / "flux", seed=0)
    panel = json.dumps({"hpsv2": tiny["hpsv2"], "clip_score": tiny["clip_score"]})
    fid = json.dumps({"extractor": "inception", "weights": str(inception), "reference": str(ref),
                      "cache_dir": str(tmp_path / "cache"), "kid_subset_size": 4})
    cfg = load_flow_config(ROOT / "configs" / "flux_tiny.yaml", [*SMALL,
        f"model.path={path}", "train.iterations=1", "threads=1", f"eval.rewards={panel}", f"eval.fid={fid}"])
    summary = train(cfg, out_dir=tmp_path / "run")
    evals = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert [(e["tag"], e["iteration"]) for e in evals] == [("before", 0), ("after", 1)]
    for e in evals:
        for key in ("reward/brightness", "heldout/hpsv2", "heldout/clip_score", "heldout/clip_score/cos", "fd", "kid"):
            assert isinstance(e[key], float) and math.isfinite(e[key]), key
        rep = e["fd_report"]
        assert rep["fd"] == e["fd"] and rep["n_gen"] == 8 and rep["n_ref"] == 6 and rep["kid_subset_size"] == 4
        assert rep["extractor"] == e["fd_extractor"] and "inception" in rep["extractor"].lower()
        assert len(rep["weights_sha256"]) == 64 and len(rep["ref_stats_sha256"]) == 64 and rep["per_frame"] is False
        assert rep["resolution"] == [32, 32]
    assert evals[1]["fd"] == summary["eval_after"]["fd"]
    assert len(list((tmp_path / "cache").glob("*.npz"))) == 1  # the reference statistics: computed once, cached
    # the held-out panel is not the training reward: it never reaches the advantage
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert not any(k.startswith(("reward/hpsv2", "reward/clip_score")) for r in rows for k in r)

    # `difrl eval RUN_DIR` on held-out prompts from a .jsonl: the run's LoRA, its panel, written to --out; without
    # --out it is appended to the run's eval.json
    from difrl.cli import main

    prompts = tmp_path / "heldout.jsonl"
    prompts.write_text('{"prompt": "a sign that says \\"hi\\"", "text": "hi"}\n{"prompt": "a green field"}\n')
    out = tmp_path / "cli_eval.json"
    assert main(["eval", str(tmp_path / "run"), "--prompts", str(prompts), "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["samples"] == 4 and got["eval_prompts"] == str(prompts) and got["policy"].endswith("lora")
    assert math.isfinite(got["heldout/hpsv2"]) and math.isfinite(got["fd"]) and got["fd_report"]["n_gen"] == 4
    # a published protocol's preset: GenEval records as the prompt file, its rules as the panel (a synthetic detector
    # that reads the detections from each record here; a real run names a detector with local weights)
    records = tmp_path / "geneval.jsonl"
    det = {"class": "cat", "score": 0.95, "box": [2, 2, 20, 20]}  # above the counting threshold 0.9
    records.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "a photo of a cat", "tag": "single_object", "include": [{"class": "cat", "count": 1}],
         "exclude": [], "detections": [det]},
        {"prompt": "a photo of two cats", "tag": "counting", "include": [{"class": "cat", "count": 2}],
         "exclude": [{"class": "cat", "count": 3}], "detections": [det]}]) + "\n")
    assert main(["eval", str(tmp_path / "run"), "--preset", "geneval", "--prompts", str(records), "--preset-options",
                 '{"detector": "synthetic", "check_prompt": false}', "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["heldout/geneval/strict"] == pytest.approx(0.5) and got["heldout/geneval"] == pytest.approx(0.75)
    assert main(["eval", str(tmp_path / "run")]) == 0
    assert [e["tag"] for e in json.loads((tmp_path / "run" / "eval.json").read_text())] == ["before", "after",
                                                                                             "difrl-eval"]


def test_panel_is_refused_on_the_digits_world():
    from difrl.config import ConfigError
    from difrl.train.config import load_flow_config

    with pytest.raises(ConfigError, match="eval.rewards"):
        load_flow_config(None, ["eval.rewards={brightness: {}}"])
    with pytest.raises(ConfigError, match="eval.fid.reference"):
        load_flow_config(None, ["eval.fid.reference=/tmp/x"])


def test_tensorboard_tracker_logs_every_iteration(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from difrl.config import ConfigError
    from difrl.train.config import load_flow_config
    from difrl.train.flow import train

    tiny = ["seed=3", "sampler.num_steps=4", "rollout.prompts_per_iter=2", "rollout.group_size=4", "train.micro_batch=6",
            "train.grad_accum=2", "train.iterations=3", "eval.every=2", "eval.per_digit=2", "eval.num_steps=3",
            "threads=1"]
    train(load_flow_config(None, [*tiny, "log_with=[tensorboard]"]), out_dir=tmp_path / "r")
    assert not (tmp_path / "bad").exists()
    events = list((tmp_path / "r" / "tensorboard").rglob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(events[0].parent)).Reload()
    rows = [json.loads(ln) for ln in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    logged = acc.Scalars("reward_mean")
    assert [e.step for e in logged] == [1, 2, 3]
    assert [e.value for e in logged] == pytest.approx([r["reward_mean"] for r in rows])
    assert [e.step for e in acc.Scalars("eval/accuracy")] == [2]
    with pytest.raises(ConfigError, match="log_with.*tensorbord"):  # at load time: nothing is written
        load_flow_config(None, [*tiny, "log_with=[tensorbord]"])


def test_tiny_wan_eval_has_per_frame_and_clip_level_fd(tmp_path):
    from PIL import Image

    from difrl.models.tiny import make_tiny_pipeline
    from difrl.rewards.tiny import tiny_reward_options
    from difrl.train.config import load_flow_config
    from difrl.train.flow import train

    tiny = tiny_reward_options(tmp_path / "rewards")
    g = torch.Generator().manual_seed(1)
    frames_dir, clips_dir = tmp_path / "frames", tmp_path / "clips"
    frames_dir.mkdir()
    clips_dir.mkdir()
    for i in range(3):  # reference clips of 6 frames (other lengths than the samples' 5), and their frames as images
        frames = [Image.fromarray((torch.rand(32, 32, 3, generator=g) * 255).to(torch.uint8).numpy()) for _ in range(6)]
        frames[0].save(clips_dir / f"{i}.gif", save_all=True, append_images=frames[1:], duration=100, loop=0)
        for j, f in enumerate(frames):
            f.save(frames_dir / f"{i}_{j}.png")
    fid = json.dumps({"extractor": "clip", "weights": tiny["clip_score"]["model_dir"], "reference": str(frames_dir),
                      "reference_clips": str(clips_dir), "cache_dir": str(tmp_path / "cache"), "kid_subset_size": 3})
    wan = make_tiny_pipeline("wan", tmp_path / "wan", seed=0)
    cfg = load_flow_config(ROOT / "configs" / "flux_tiny.yaml", [*SMALL,
        "model.kind=wan", f"model.path={wan}", "model.num_frames=5", "sampler.guidance=1.0", "train.iterations=1",
        "threads=1", f"eval.fid={fid}"])
    train(cfg, out_dir=tmp_path / "run")
    after = json.loads((tmp_path / "run" / "eval.json").read_text())[-1]
    assert after["fd_report"]["per_frame"] is True and after["fd_report"]["n_gen"] == 8 * 5  # 8 clips x 5 frames
    assert after["fd_report"]["n_ref"] == 18
    rep = after["fd_clip_report"]
    assert math.isfinite(after["fd_clip"]) and rep["n_gen"] == 8 and rep["n_ref"] == 3 and rep["dim"] == 32
    assert "clip(mean,motion)" in rep["extractor"] and math.isfinite(after["kid_clip"])

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


def fd_closed_form(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fréchet distance of two feature sets [N, D] (float64), written out without a D x D matrix square root:
    |mu_a - mu_b|^2 + tr S_a + tr S_b - 2 tr (S_a S_b)^(1/2), where with centred rows X_a, X_b and
    S = X^T X / (N - 1), tr (S_a S_b)^(1/2) is the sum of the singular values of X_a X_b^T / sqrt((N_a-1)(N_b-1))."""
    a, b = a.double(), b.double()
    xa, xb = a - a.mean(0), b - b.mean(0)
    na, nb = a.shape[0] - 1, b.shape[0] - 1
    cross = torch.linalg.svdvals(xa @ xb.T / math.sqrt(na * nb)).sum()
    return float(((a.mean(0) - b.mean(0)) ** 2).sum() + (xa ** 2).sum() / na + (xb ** 2).sum() / nb - 2 * cross)


def kid_subsets(real: torch.Tensor, fake: torch.Tensor, subsets: int, m: int, seed: int = 0) -> float:
    """KID (Binkowski et al. 2018): the mean over subsets of the unbiased MMD^2 with the kernel (x.y / D + 1)^3,
    subsets drawn as torchmetrics draws them (per subset: randperm(real), then randperm(fake), one generator)."""
    real, fake = real.double(), fake.double()
    k = lambda x, y: (x @ y.T / x.shape[1] + 1) ** 3  # noqa: E731
    g = torch.Generator().manual_seed(seed)
    vals = []
    for _ in range(subsets):
        x = real[torch.randperm(real.shape[0], generator=g)[:m]]
        y = fake[torch.randperm(fake.shape[0], generator=g)[:m]]
        kxx, kyy, kxy = k(x, x), k(y, y), k(x, y)
        vals.append(float((kxx.sum() - kxx.diagonal().sum()) / (m * (m - 1))
                          + (kyy.sum() - kyy.diagonal().sum()) / (m * (m - 1)) - 2 * kxy.mean()))
    return sum(vals) / len(vals)


def _record_panel(monkeypatch) -> list:
    """Every EvalPanel call's (images, prompts, result) (test-side recording)."""
    from difrl.eval import panel

    calls, real = [], panel.EvalPanel.__call__

    def call(self, images, prompts, *a):
        out = real(self, images, prompts, *a)
        calls.append((images.detach().clone(), list(prompts), out))
        return out

    monkeypatch.setattr(panel.EvalPanel, "__call__", call)
    return calls


@pytest.mark.slow  # end to end, several seconds: left out by `make test-fast`
def test_tiny_flux_eval_json_holds_fid_kid_and_the_heldout_panel(tmp_path, monkeypatch):
    import numpy as np
    from PIL import Image

    from difrl.eval.extractors import save_random_inception_weights
    from difrl.models.adapters import make_tiny_pipeline
    from difrl.rewards.tiny import tiny_reward_options
    from difrl.train.config import load_flow_config
    from difrl.train.flow.trainer import train

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
    calls = _record_panel(monkeypatch)
    summary = train(cfg, out_dir=tmp_path / "run")
    evals = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert [(e["tag"], e["iteration"]) for e in evals] == [("before", 0), ("after", 1)]
    assert len(calls) == 2
    # the values, recomputed from the evaluation samples: held-out rewards as the means of the rewards' scores,
    # FD / KID from Inception features of the rounded pixels (torch-fidelity's network called here) against the
    # reference PNGs loaded here, with the closed forms written above
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    from difrl.rewards import build_reward

    net = FeatureExtractorInceptionV3("inception-v3-compat", ["2048"], feature_extractor_weights_path=str(inception)).eval()
    feats = lambda x: net((x.clamp(0, 1) * 255).round().to(torch.uint8))[0].double()  # noqa: E731
    refs = torch.stack([torch.from_numpy(np.array(Image.open(p).convert("RGB").resize((32, 32), Image.BICUBIC)))
                        .permute(2, 0, 1) for p in sorted(ref.glob("*.png"))]).float() / 255
    hps, clip = build_reward("hpsv2", **tiny["hpsv2"]), build_reward("clip_score", **tiny["clip_score"])
    with torch.no_grad():
        ref_feats = feats(refs)
        for e, (images, prompts, _) in zip(evals, calls):
            assert images.shape == (8, 3, 32, 32)
            # re-scored here in one batch (the run may chunk): fp32 reordering; FD / KID as stated in test_eval_fid
            assert e["reward/brightness"] == pytest.approx(float(images.mean()), rel=1e-5)
            assert e["heldout/hpsv2"] == pytest.approx(float(hps(images, prompts)["hpsv2"].mean()), rel=1e-5)
            c = clip(images, prompts)
            assert e["heldout/clip_score"] == pytest.approx(float(c["clip_score"].mean()), rel=1e-5)
            assert e["heldout/clip_score/cos"] == pytest.approx(float(c["cos"].mean()), rel=1e-5)
            gen_feats = feats(images)
            assert e["fd"] == pytest.approx(fd_closed_form(gen_feats, ref_feats), rel=1e-4)
            assert e["kid"] == pytest.approx(kid_subsets(ref_feats, gen_feats, 100, 4), rel=1e-6, abs=1e-9)
    assert evals[0]["fd"] != evals[1]["fd"]  # the trained policy's samples differ from the base's
    for e in evals:
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
    assert got["heldout/geneval/strict"] == pytest.approx(0.5, rel=1e-6) and got["heldout/geneval"] == pytest.approx(
        0.75, rel=1e-6)  # fp32 means of a few rule scores
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
    from difrl.train.flow.trainer import train

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
    assert [e.value for e in logged] == pytest.approx([r["reward_mean"] for r in rows], rel=1e-6)  # TB keeps float32
    assert [e.step for e in acc.Scalars("eval/accuracy")] == [2]
    with pytest.raises(ConfigError, match="log_with.*tensorbord"):  # at load time: nothing is written
        load_flow_config(None, [*tiny, "log_with=[tensorbord]"])


def test_tiny_wan_eval_has_per_frame_and_clip_level_fd(tmp_path, monkeypatch):
    import numpy as np
    from PIL import Image, ImageSequence

    from difrl.models.adapters import make_tiny_pipeline
    from difrl.rewards.tiny import tiny_reward_options
    from difrl.train.config import load_flow_config
    from difrl.train.flow.trainer import train

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
    calls = _record_panel(monkeypatch)
    train(cfg, out_dir=tmp_path / "run")
    after = json.loads((tmp_path / "run" / "eval.json").read_text())[-1]
    assert after["fd_report"]["per_frame"] is True and after["fd_report"]["n_gen"] == 8 * 5  # 8 clips x 5 frames
    assert after["fd_report"]["n_ref"] == 18
    rep = after["fd_clip_report"]
    assert rep["n_gen"] == 8 and rep["n_ref"] == 3 and rep["dim"] == 32 and "clip(mean,motion)" in rep["extractor"]
    # the values, recomputed from the evaluation clips with transformers' CLIP image features of the rounded pixels
    # (what a PNG holds, the extractor's convention; 32 x 32 frames: no resize, OpenAI mean/std) and the closed forms
    # above: per frame against the reference frames, and per clip on [mean frame feature, mean |change between
    # frames|] against the reference GIFs
    from transformers import CLIPModel

    clip = CLIPModel.from_pretrained(tiny["clip_score"]["model_dir"], local_files_only=True).eval()
    mean, std = torch.tensor([0.48145466, 0.4578275, 0.40821073]), torch.tensor([0.26862954, 0.26130258, 0.27577711])

    def feats(frames):  # [N, 3, 32, 32] in [0, 1] -> [N, 16] float64
        frames = (frames.clamp(0, 1) * 255).round() / 255
        out = clip.get_image_features(pixel_values=(frames - mean.view(1, 3, 1, 1)) / std.view(1, 3, 1, 1))
        return (out.pooler_output if hasattr(out, "pooler_output") else out).double()

    def clip_feature(f):  # [F, D] -> [2 D]
        return torch.cat([f.mean(0), (f[1:] - f[:-1]).abs().mean(0)])

    def load(img):
        return torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1).float() / 255

    videos = calls[-1][0]
    assert videos.shape == (8, 5, 3, 32, 32)
    with torch.no_grad():
        gen = feats(videos.flatten(0, 1))
        ref_frames = feats(torch.stack([load(Image.open(p)) for p in sorted(frames_dir.glob("*.png"))]))
        ref_clips = torch.stack([clip_feature(feats(torch.stack([load(f) for f in ImageSequence.Iterator(Image.open(p))])))
                                 for p in sorted(clips_dir.glob("*.gif"))])
    gen_clips = torch.stack([clip_feature(f) for f in gen.view(8, 5, -1)])
    # the same features re-derived here, float64 statistics in another order (test_eval_fid's tolerances)
    assert after["fd"] == pytest.approx(fd_closed_form(gen, ref_frames), rel=1e-6)
    assert after["fd_clip"] == pytest.approx(fd_closed_form(gen_clips, ref_clips), rel=1e-6)
    assert after["kid_clip"] == pytest.approx(kid_subsets(ref_clips, gen_clips, 100, 3), rel=1e-5, abs=1e-9)

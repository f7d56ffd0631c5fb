"""The reward seam: the protocol (chunks, device, dtype, inference mode, shapes), how rewards are found
(registry, module:function, entry points), failures that never score, overlapped scoring, video rewards,
and training with several rewards at once (digits and a tiny FLUX pipeline).

    HF_HUB_OFFLINE=1 .venv/bin/python -m pytest tests/test_rewards.py -q
"""

from __future__ import annotations

import json
import math
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import difrl.rewards as rewards_mod
from difrl.rewards import REWARDS, Reward, RewardError, Scoring, build_reward, register_reward, score_all
from difrl.rewards.base import RewardConfigError, RewardModel
from difrl.rewards.video import frame_indices, temporal_consistency
from difrl.train.reward_stage import valid_group_advantages
from tolerances import FP32_REORDER

ROOT = Path(__file__).resolve().parent.parent


class Recorder(RewardModel):
    """Mean pixel value; records what each call saw."""
    modality = "image"

    def __init__(self, batch_size=None, dtype="float32"):
        super().__init__(device="cpu", dtype=dtype, batch_size=batch_size)
        self.calls = []

    def score(self, images, prompts, metadata):
        self.calls.append((images.shape[0], images.dtype, torch.is_inference_mode_enabled(), len(metadata)))
        return images.flatten(1).mean(1)  # a bare [B] tensor: the wrapper files it under the reward's name


@pytest.fixture
def registered():
    added = []

    def add(name, factory):
        register_reward(name)(factory)
        added.append(name)
        return name

    yield add
    for name in added:
        REWARDS.pop(name, None)


# ---------------------------------------------------------------------------------------- protocol


def test_reward_chunks_casts_and_runs_without_autograd(registered):
    registered("test_recorder", Recorder)
    images = torch.rand(7, 3, 4, 4, requires_grad=True)
    whole = build_reward("test_recorder")(images, ["p"] * 7, [{}] * 7)
    fn = build_reward("test_recorder", batch_size=3, dtype="float64")
    chunked = fn(images, ["p"] * 7, [{}] * 7)
    assert fn.fn.calls == [(3, torch.float64, True, 3), (3, torch.float64, True, 3), (1, torch.float64, True, 1)]
    assert chunked["test_recorder"].dtype == torch.float32 and not chunked["test_recorder"].requires_grad
    assert torch.allclose(whole["test_recorder"], chunked["test_recorder"], **FP32_REORDER)  # other batch shapes
    assert fn.info()["batch_size"] == 3 and fn.info()["modality"] == "image" and fn.info()["weights_sha256"] == ""


def test_reward_checks_modality_and_output(registered):
    registered("test_recorder", Recorder)
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\].*use reward 'video'"):
        build_reward("test_recorder")(torch.rand(2, 4, 3, 8, 8), ["a", "b"])
    registered("test_short", lambda: (lambda x, p, m: torch.zeros(len(p) - 1)))
    with pytest.raises(ValueError, match="returned 1 values under 'test_short' for 2 samples"):
        build_reward("test_short")(torch.rand(2, 3, 4, 4), ["a", "b"])
    registered("test_wrong_key", lambda: (lambda x, p, m: {"other": torch.zeros(len(p))}))
    with pytest.raises(ValueError, match="under 'test_wrong_key'"):
        build_reward("test_wrong_key")(torch.rand(2, 3, 4, 4), ["a", "b"])
    with pytest.raises(RewardConfigError, match="bad options.*it takes: batch_size, dtype"):
        build_reward("test_recorder", batchsize=2)


def test_module_function_and_entry_point_rewards_are_found(tmp_path, monkeypatch):
    pkg = tmp_path / "site"
    (pkg / "myrewards").mkdir(parents=True)
    (pkg / "myrewards" / "__init__.py").write_text(textwrap.dedent("""
        import torch

        def redness(scale=1.0):
            def fn(images, prompts, metadata):
                return {"redness": scale * images[:, 0].flatten(1).mean(1)}
            return fn
    """))
    dist = pkg / "myrewards-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: myrewards\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[difrl.rewards]\nplugin_red = myrewards:redness\n")
    monkeypatch.syspath_prepend(str(pkg))
    rewards_mod._entry_point_rewards.cache_clear()
    try:
        images = torch.zeros(2, 3, 4, 4)
        images[0, 0] = 1.0
        by_path = build_reward("myrewards:redness", scale=2.0)
        assert by_path.key == "redness" and by_path(images, ["a", "b"])["redness"].tolist() == [2.0, 0.0]
        by_entry_point = build_reward("plugin_red")  # the entry point's name; the function's key is "redness"
        assert by_entry_point.fn.__qualname__.startswith("redness")
        with pytest.raises(ValueError, match="unknown reward 'nope'.*plugin_red"):
            build_reward("nope")
    finally:
        rewards_mod._entry_point_rewards.cache_clear()
        sys.modules.pop("myrewards", None)


# ---------------------------------------------------------------------------------------- failures


def failing(kind: str):
    def factory():
        def fn(images, prompts, metadata):
            s = images.flatten(1).mean(1).clone()
            if kind == "raise":
                raise OSError("scorer crashed")
            if kind == "nan":
                s[1] = float("nan")
            if kind == "inf":
                s[2] = float("inf")
            if kind == "short":
                s = s[:-1]
            return s
        return fn
    return factory


@pytest.mark.parametrize("kind", ["raise", "nan", "inf", "short"])
def test_a_failing_reward_names_itself_and_the_samples_and_never_scores(kind, registered):
    name = registered(f"test_fail_{kind}", failing(kind))
    images = torch.rand(4, 3, 4, 4)
    ids, seeds = torch.tensor([10, 10, 11, 11]), torch.tensor([100, 101, 102, 103])
    rewards = {"brightness": build_reward("brightness"), name: build_reward(name)}
    with pytest.raises(RewardError) as err:
        score_all(rewards, images, ["a"] * 4, [{}] * 4, seeds, ids)
    msg, e = str(err.value), err.value
    assert name in msg and "prompt ids [" in msg and "seeds [" in msg
    # the reward's own exception is the RewardError's cause (its traceback; a NaN has no exception)
    assert (e.__cause__ is not None) == (kind in ("raise", "short"))
    expected_bad = {"raise": [1, 1, 1, 1], "short": [1, 1, 1, 1], "nan": [0, 1, 0, 0], "inf": [0, 0, 1, 0]}[kind]
    assert e.bad.long().tolist() == expected_bad
    if kind in ("nan", "inf"):
        assert "seeds [10" + ("1" if kind == "nan" else "2") in msg
    # a failed sample has no score under any reward: NaN, never 0
    for v in e.scores.values():
        assert torch.isnan(v[e.bad]).all() and torch.isfinite(v[~e.bad]).all()


def test_failed_groups_never_reach_other_groups_advantages():
    """A NaN in one group: the other groups' advantages equal those computed without that group at all, even
    with a batch-wide std (advantage.std_scope=global)."""
    class Cfg:
        std_scope, eps, clip, scale = "global", 1e-4, 5.0, "std"
    r = torch.tensor([0.1, 0.5, 0.9, 0.2, 0.4, float("nan"), 0.3, 0.8, 0.6])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    bad = torch.isnan(r)
    adv, failed = valid_group_advantages({"x": r}, {"x": 1.0}, groups, bad, Cfg, "reward_sum")
    assert failed.tolist() == [False] * 3 + [True] * 3 + [False] * 3
    keep = ~failed
    ref, _ = valid_group_advantages({"x": r[keep]}, {"x": 1.0}, groups[keep], torch.zeros(6, dtype=torch.bool), Cfg,
                                    "reward_sum")
    # exact: the failed group is dropped first, then the same ops
    assert torch.equal(adv.advantages[keep], ref.advantages)
    assert (adv.advantages[failed] == 0).all() and torch.isnan(adv.reward[failed]).all()


# ---------------------------------------------------------------------------------------- overlap


@pytest.mark.parametrize("overlap", [False, True])
def test_scoring_in_chunks_equals_one_batch_and_localises_failures(overlap, registered):
    name = registered("test_fail_nan", failing("nan"))
    images = torch.rand(6, 3, 4, 4)
    ids, seeds = torch.arange(6), torch.arange(6) + 50
    rewards = {"brightness": build_reward("brightness")}
    one = score_all(rewards, images, ["a"] * 6, [{}] * 6, seeds, ids)
    scoring = Scoring(rewards, overlap=overlap)
    for lo in (0, 2, 4):
        scoring.submit(images[lo:lo + 2] * 2 - 1, ["a"] * 2, [{}] * 2, decode=lambda x: (x + 1) / 2)
    # exact: torch.rand's values lie on the 2^-24 grid, so x * 2 - 1 and back is exact, and each image's mean is the
    # same 48-term reduction in either batch
    assert torch.equal(scoring.result(ids, seeds)["brightness"], one["brightness"])

    scoring = Scoring({**rewards, name: build_reward(name)}, overlap=overlap)
    for lo in (0, 3):  # each chunk has its sample 1 NaN: global samples 1 and 4
        scoring.submit(images[lo:lo + 3], ["a"] * 3, [{}] * 3)
    with pytest.raises(RewardError) as err:
        scoring.result(ids, seeds)
    assert err.value.bad.nonzero().flatten().tolist() == [1, 4] and "seeds [51, 54]" in str(err.value)


# ---------------------------------------------------------------------------------------- video


def test_video_reward_over_frames_and_temporal_consistency():
    assert frame_indices(8, None).tolist() == list(range(8))
    assert frame_indices(8, 3).tolist() == [0, 4, 7] and frame_indices(8, 1).tolist() == [4]
    video = torch.zeros(2, 4, 3, 2, 2)
    video[0] = torch.tensor([0.2, 0.4, 0.6, 0.8]).view(4, 1, 1, 1)  # brightening: frame means .2 .4 .6 .8
    video[1] = 0.5  # still
    assert torch.allclose(temporal_consistency(video), torch.tensor([0.8, 1.0]), **FP32_REORDER)  # fp32 means
    fn = build_reward("video", image_reward="brightness", reduce="min", temporal_weight=0.5)
    assert fn.modality == "video"
    out = fn(video, ["a", "b"], [{}, {}])
    assert torch.allclose(out["video"], torch.tensor([0.2 + 0.4, 0.5 + 0.5]), **FP32_REORDER)
    assert torch.allclose(out["frame_mean"], torch.tensor([0.5, 0.5]), **FP32_REORDER)
    assert torch.allclose(build_reward("video", image_reward="brightness", frames=2)(video, ["a", "b"])["video"],
                          torch.tensor([0.5, 0.5]), **FP32_REORDER)  # frames 0 and 3
    with pytest.raises(ValueError, match=r"\[B, F, 3, H, W\]"):
        fn(video[:, 0], ["a", "b"])
    with pytest.raises(RewardConfigError, match="reduce must be"):
        build_reward("video", reduce="max")


def test_imagereward_says_why_it_cannot_run_here():
    try:
        import ImageReward  # noqa: F401
    except Exception:
        pass
    else:
        pytest.skip("image-reward imports in this environment")
    ckpt, med = ROOT / "pyproject.toml", ROOT / "README.md"  # any existing files: the import check comes after
    with pytest.raises(RewardConfigError, match="image-reward package does not import here.*separate environment"):
        build_reward("imagereward", checkpoint=str(ckpt), med_config=str(med))
    with pytest.raises(RewardConfigError, match="reward 'imagereward' needs the ImageReward checkpoint"):
        build_reward("imagereward")


# ---------------------------------------------------------------------------------------- training


TINY = [
    "seed=3", "sampler.num_steps=4", "rollout.prompts_per_iter=2", "rollout.group_size=4",
    "train.micro_batch=6", "train.grad_accum=2", "train.iterations=2", "train.lr=1e-3",
    "eval.every=0", "eval.per_digit=2", "eval.num_steps=3", "threads=1",
]


def rows(run_dir: Path) -> list[dict]:
    from difrl.train.flow.trainer import TIMING_KEYS

    out = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in out]


@pytest.mark.parametrize("aggregate", ["reward_sum", "advantage_sum"])
def test_digits_trains_with_two_rewards(aggregate, tmp_path):
    from difrl.train.config import load_flow_config
    from difrl.train.flow.trainer import train

    cfg = load_flow_config(None, [*TINY, "reward.weights={digit_prob: 1.0, brightness: 0.5}",
                                  f"reward.aggregate={aggregate}"])
    train(cfg, out_dir=tmp_path / "r")
    for r in rows(tmp_path / "r"):
        for key in ("reward/digit_prob", "reward/brightness", "reward/digit_prob/correct", "reward_norm/digit_prob",
                    "reward_norm/brightness"):
            assert math.isfinite(r[key]), key
        # the mean of weighted sums against the weighted sum of means: fp32 in another order
        assert r["reward_mean"] == pytest.approx(r["reward/digit_prob"] + 0.5 * r["reward/brightness"], abs=1e-5)
        assert 0 < r["reward_norm/brightness"] <= 5.0


def test_reward_stats_counts_the_groups_whose_correct_flag_does_not_vary():
    from types import SimpleNamespace

    from difrl.train.reward_stage import reward_stats

    # 4 groups of 3 (ids not contiguous): all right, mixed, all wrong, mixed; a failed sample (NaN reward) in the
    # last group leaves it uniform (its two scored samples are both right)
    groups = torch.tensor([7, 7, 7, 2, 2, 2, 9, 9, 9, 4, 4, 4])
    correct = torch.tensor([1., 1., 1., 0., 1., 1., 0., 0., 0., 1., 1., 0.])
    reward = correct.clone()
    reward[11] = float("nan")
    adv = SimpleNamespace(std_scope="group", eps=1e-4, scale=True)
    row = reward_stats(reward, {"digit_prob": correct, "digit_prob/correct": correct}, {"digit_prob": 1.0}, groups, adv)
    assert row["reward/digit_prob/correct/uniform_groups"] == 0.75
    assert "reward/digit_prob/uniform_groups" not in row  # only a flag named .../correct is counted


def test_overlapped_scoring_trains_exactly_like_serial(tmp_path):
    from difrl.train.config import load_flow_config
    from difrl.train.flow.trainer import train

    for overlap in ("false", "true"):
        cfg = load_flow_config(None, [*TINY, "rollout.chunks=2", f"reward.overlap={overlap}"])
        train(cfg, out_dir=tmp_path / overlap)
    assert rows(tmp_path / "false") == rows(tmp_path / "true")


@pytest.mark.parametrize("mode", [["rollout.chunks=2", "reward.overlap=true", "rollout.prompts_per_iter=4"],
                                  ["rollout.kind=tree", "tree.split_steps=[0,1]"],
                                  ["rollout.kind=solrl", "rollout.precision=nvfp4", "solrl.candidates=8",
                                   "solrl.preview_steps=3"]], ids=["overlap", "tree", "solrl"])
def test_drop_group_keeps_training_finite_in_every_rollout_mode(mode, tmp_path, registered):
    """A NaN reward on one sample per call under reward.on_error=drop_group: its group is dropped, the log and the
    weights stay finite (a NaN never reaches a loss), in flat-overlapped, tree and Sol-RL rollouts."""
    from difrl.train.config import load_flow_config
    from difrl.train.flow.trainer import train

    name = registered("test_fail_nan", failing("nan"))
    cfg = load_flow_config(None, [*TINY, *mode, f"reward.weights={{{name}: 1.0}}", "reward.on_error=drop_group",
                                  "reward.max_failed_frac=0.5",
                                  "advantage.std_scope=global"])
    train(cfg, out_dir=tmp_path / "r")
    for r in rows(tmp_path / "r"):
        assert r["failed_reward_groups"] >= 1 and r["trained_samples"] > 0 and r["dropped_groups"] >= 1
        assert all(math.isfinite(r[k]) for k in ("reward_mean", "reward_std", "loss", "adv_mean", f"reward/{name}"))
    from difrl.utils.io import load_safetensors_checked

    ckpt = tmp_path / "r" / "checkpoints" / (tmp_path / "r" / "checkpoints" / "latest").read_text().strip()
    weights, _ = load_safetensors_checked(ckpt / "trainable.safetensors", "test")
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_broken_rewards_stop_even_under_drop_group(tmp_path, registered):
    """drop_group is for flaky scores: a contract violation (wrong length) stops the run, a reward failing on every
    sample stops it, and so does a failed fraction above reward.max_failed_frac; each after a checkpoint."""
    from difrl.train.config import load_flow_config
    from difrl.train.flow.trainer import train

    from difrl.rewards.base import RewardConfigError

    # a reward that always breaks its contract (wrong length) is caught by the start-up probe, before any work
    registered("test_fail_short", failing("short"))
    cfg = load_flow_config(None, [*TINY, "reward.weights={test_fail_short: 1.0}", "reward.on_error=drop_group"])
    with pytest.raises(RewardConfigError, match="cannot score this world's samples.*returned 1 values"):
        train(cfg, out_dir=tmp_path / "short")
    assert not (tmp_path / "short" / "checkpoints").exists()
    cases = {"raise": ("test_fail_raise", [], "every sample's reward failed"),
             "nan": ("test_fail_nan", ["reward.max_failed_frac=0.1"], r"1 of 8 samples \(12.5%\) failed so far")}
    for kind, (name, extra, message) in cases.items():
        registered(name, failing(kind))
        cfg = load_flow_config(None, [*TINY, f"reward.weights={{{name}: 1.0}}", "reward.on_error=drop_group", *extra])
        with pytest.raises(RewardError, match=message):
            train(cfg, out_dir=tmp_path / kind)
        assert (tmp_path / kind / "checkpoints" / "iter-000000").is_dir(), kind
        # the checkpoint is of the iteration before the failing one: a resume redoes it, so it holds none of its counts
        state = json.loads((tmp_path / kind / "checkpoints" / "iter-000000" / "state.json").read_text())
        assert (state["reward_failed"], state["reward_scored"]) == (0, 0), (kind, state)


@pytest.mark.slow  # end to end, several seconds: left out by `make test-fast`
def test_tiny_flux_trains_with_two_reward_models(tmp_path, monkeypatch):
    """Tiny FLUX trained on two plug-in reward models at once (HPSv2 and CLIP score on tiny backbones in their real
    file layouts), weighted sum and GDPO-style; then tiny Wan on a video reward over its frames."""
    pytest.importorskip("diffusers")
    pytest.importorskip("open_clip")
    from difrl.models.adapters import make_tiny_pipeline
    from difrl.rewards.tiny import tiny_reward_options
    from difrl.train.config import load_flow_config
    from difrl.train.flow.trainer import train

    tiny = tiny_reward_options(tmp_path / "rewards")
    options = json.dumps({"hpsv2": tiny["hpsv2"], "clip_score": tiny["clip_score"]})
    path = make_tiny_pipeline("flux", tmp_path / "flux", seed=0)
    import difrl.rewards as rewards_mod

    calls, call_rewards = [], rewards_mod.call_rewards  # what the rewards are called on (test-side recording)

    def record(rw, samples, prompts, metadata, decode=None):
        images = decode(samples) if decode is not None else samples
        calls.append((images.detach().clone(), list(prompts)))
        return call_rewards(rw, images, prompts, metadata)

    monkeypatch.setattr(rewards_mod, "call_rewards", record)
    hps, clip = build_reward("hpsv2", **tiny["hpsv2"]), build_reward("clip_score", **tiny["clip_score"])
    for aggregate in ("reward_sum", "advantage_sum"):
        calls.clear()
        cfg = load_flow_config(ROOT / "configs" / "flux_tiny.yaml", [
            f"model.path={path}", "train.iterations=1", "eval.every=0", "threads=1", f"reward.aggregate={aggregate}",
            "reward.weights={hpsv2: 1.0, clip_score: 0.5}", f"reward.options={options}"])
        train(cfg, out_dir=tmp_path / aggregate)
        (r,) = rows(tmp_path / aggregate)
        for key in ("reward/hpsv2", "reward/clip_score", "reward/clip_score/cos", "reward_norm/hpsv2",
                    "reward_norm/clip_score"):
            assert math.isfinite(r[key]), key
        assert r["failed_reward_groups"] == 0
        # the logged means are the two rewards' mean scores on the iteration's samples
        (images, prompts), = [c for c in calls if len(c[1]) == 32]  # the iteration's 4 x 8 rollout
        # the rewards re-scored here in one batch of 32 (the trainer may have chunked them): fp32 reordering
        assert r["reward/hpsv2"] == pytest.approx(float(hps(images, prompts)["hpsv2"].mean()), rel=1e-5)
        c = clip(images, prompts)
        assert r["reward/clip_score"] == pytest.approx(float(c["clip_score"].mean()), rel=1e-5)
        assert r["reward/clip_score/cos"] == pytest.approx(float(c["cos"].mean()), rel=1e-5)
        summary = json.loads((tmp_path / aggregate / "summary.json").read_text())
        assert math.isfinite(summary["eval_after"]["reward/hpsv2"])

    wan = make_tiny_pipeline("wan", tmp_path / "wan", seed=0)
    video = json.dumps({"video": {"image_reward": "clip_score", "image_options": tiny["clip_score"], "frames": 2,
                                  "temporal_weight": 0.1}})
    cfg = load_flow_config(ROOT / "configs" / "flux_tiny.yaml", [
        "model.kind=wan", f"model.path={wan}", "model.num_frames=5", "sampler.guidance=1.0", "train.iterations=1",
        "eval.every=0", "threads=1", "reward.weights={video: 1.0}", f"reward.options={video}"])
    train(cfg, out_dir=tmp_path / "wan_run")
    (r,) = rows(tmp_path / "wan_run")
    assert math.isfinite(r["reward/video"]) and 0 <= r["reward/video/temporal"] <= 1
    assert (tmp_path / "wan_run" / "samples").is_dir()


def test_jsonl_prompt_file_gives_metadata(tmp_path):
    from difrl.worlds.diffusers import read_prompts

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a photo of a cat", "tag": "single_object", "include": [{"class": "cat", "count": 1}]}\n\n'
                 '{"prompt": "a sign that says \\"hi\\"", "text": "hi"}\n')

    class MC:
        prompts, prompt_file = None, str(f)
    prompts, meta = read_prompts(MC)
    assert prompts == ["a photo of a cat", 'a sign that says "hi"']
    assert meta[0]["include"] == [{"class": "cat", "count": 1}] and meta[1]["text"] == "hi"
    f.write_text('{"prompt": "ok"}\n{"no_prompt": 1}\n')
    with pytest.raises(ValueError, match="line 2: expected an object"):
        read_prompts(MC)


def test_every_module_that_registers_a_reward_is_a_builtin():
    """A built-in reward is its file plus its module name in BUILTIN_MODULES: a file that registers rewards but is
    missing there would never be found by name."""
    import re

    folder = Path(rewards_mod.__file__).parent
    registering = {p.stem for p in folder.glob("*.py") if re.search(r"^@register_reward\(", p.read_text(), re.M)}
    assert registering == set(rewards_mod.BUILTIN_MODULES)
    rewards_mod.describe_rewards()  # loads the built-ins
    assert {"digit_prob", "clip_score", "geneval", "sudoku_cells", "text_correct", "video"} <= set(REWARDS)

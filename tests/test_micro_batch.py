"""train.micro_batch=auto and train.updates_per_epoch (difrl/train/flow/plan.py): the update a config describes stays
the same when the trained steps or the processes change, explicit values that do not divide are refused with values
that do, and the banner says what was chosen (issue 39.1).

    .venv/bin/python -m pytest tests/test_micro_batch.py -q
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from difrl.samplers import sigma_schedule
from difrl.train.flow import plan as flow_plan
from difrl.train.config import load_flow_config

ROOT = Path(__file__).resolve().parent.parent
DIGITS = ROOT / "configs" / "digits.yaml"
WORLD = SimpleNamespace(sigmas=lambda n, shift: sigma_schedule(n, shift))  # all plan_flow_iteration() needs of a world (NFT's T)
NFT = ["train.objective=nft", "nft.ref_beta=0.1", "train.kl_beta=0", "train.clip_low=1e-4", "train.clip_high=1e-4"]
# every way to change the number of trained steps T on the demo's config (the commands of docs/guides/methods.md and docs/guides/scale.md)
T_CHANGES = {
    "all_but_last": ([], 9),
    "fixed_window": (["steps.mode=fixed_window", "steps.window_size=2"], 2),
    "random_window": (["steps.mode=random_window"], 3),
    "sliding_window": (["steps.mode=sliding_window", "steps.window_size=3", "steps.advance_every=25"], 3),
    "random_subset": (["steps.mode=random_subset"], 5),
    "nft": (NFT, 6),
}


def plan(config, overrides, processes=1):
    lines = []
    out = flow_plan.plan_flow_iteration(load_flow_config(config, overrides), WORLD, processes, Path("/tmp/unused"), lines.append)
    return out, lines[0]


@pytest.mark.parametrize("change", list(T_CHANGES))
@pytest.mark.parametrize("processes", [1, 2])
def test_auto_keeps_the_updates_and_the_samples_per_update_when_the_trained_steps_change(change, processes):
    overrides, T = T_CHANGES[change]
    (n_total, per_proc, t, _, micro), banner = plan(DIGITS, overrides, processes)
    # configs/digits.yaml: 2 updates per rollout of 5 micro-batches: 16 samples each on one process, 8 on two, so
    # that an update always covers 80 of the 160 samples
    assert t == T and micro.updates == 2 and micro.records == 16 // processes and not micro.split_samples
    assert micro.transitions == micro.records * T
    assert 2 * 5 * micro.records * processes == n_total == 160
    assert (f"2 optimizer update(s) per rollout (1 epoch(s) x 2 of 5 accumulated micro-batch(es)); micro-batch: auto = "
            f"{16 // processes} sample(s) x {T} steps = {16 // processes * T} transitions per forward/backward") in banner


def test_auto_on_the_published_configs_is_their_former_explicit_micro_batch():
    # at the size each config states, auto gives the micro-batch it used to spell out in transitions
    for name, transitions, updates in (("digits", 144, 2), ("digits_solrl", 96, 2), ("moving_digits", 224, 2),
                                       ("flux_tiny", 40, 1), ("sd3_tiny", 40, 1), ("wan_tiny", 40, 1)):
        cfg = load_flow_config(ROOT / "configs" / f"{name}.yaml")
        assert cfg.train.micro_batch == "auto", name
        micro = flow_plan.micro_batching(cfg, *_t_and_records(cfg))
        assert (micro.transitions, micro.updates, micro.split_samples) == (transitions, updates, False), name


def _t_and_records(cfg):
    _, train_mask, _ = flow_plan.step_masks(cfg, 0, 1)
    T = int(train_mask.sum()) if cfg.train.objective == "grpo" else int(cfg.sampler.num_steps * cfg.nft.timestep_fraction)
    return T, False, cfg.rollout.prompts_per_iter * cfg.rollout.group_size


def test_auto_tree_edges_split_into_the_updates():
    (_, _, T, _, micro), banner = plan(DIGITS, ["rollout.kind=tree", "tree.split_steps=[0,2,4,6]"])
    assert T == 1 and micro.transitions == micro.records == 76 and micro.updates == 2  # 760 edges / (2 x 5)
    assert "auto = 76 transitions (tree edges: 760 per process trained in 2 update(s) x 5 micro-batch(es))" in banner


def _options(message: str) -> list[list[str]]:
    """The overrides each suggestion of a start-up error names ('train.k=a or b (with train.j=c)' gives two)."""
    out = []
    for part in message.split(": use ", 1)[1].split(", or "):
        keys = re.findall(r"(train\.[a-z_]+)=([0-9]+(?: or [0-9]+)*|auto|null)", part)
        (key, values), rest = keys[0], keys[1:]
        out += [[f"{key}={v}", *(f"{k}={w}" for k, w in rest)] for v in values.split(" or ")]
    return out


@pytest.mark.parametrize("overrides, processes, words", [
    # an explicit micro_batch that does not divide the window's transitions (the MixGRPO command of docs/guides/methods.md before auto)
    (["train.micro_batch=144", "steps.mode=sliding_window", "steps.window_size=3"], 1,
     "160 samples x 3 trained steps = 480 transitions per iteration, not a multiple of train.micro_batch x "
     "train.grad_accum = 144 x 5 = 720"),
    # DiffusionNFT needs whole samples
    (["train.micro_batch=100", *NFT], 1, "train.micro_batch=100 transitions is not a multiple of the 6 trained step(s)"),
    # divides, but into other updates per rollout than the config's train.updates_per_epoch
    (["train.micro_batch=48"], 1, "make 6 optimizer update(s) per pass over each process's 1440 transitions, but "
                                  "train.updates_per_epoch=2"),
    # auto, but the samples do not split into the micro-batches
    (["train.grad_accum=3"], 1, "train.micro_batch=auto takes whole samples, but each process's 160 samples do not "
                                "split into train.updates_per_epoch x train.grad_accum = 2 x 3 micro-batches"),
    (["train.updates_per_epoch=3"], 2, "each process's 80 samples do not split"),
])
def test_values_that_do_not_divide_are_refused_with_values_that_do(overrides, processes, words):
    with pytest.raises(ValueError) as e:
        plan(DIGITS, overrides, processes)
    message = str(e.value)
    assert words in message, message
    options = _options(message)
    assert len(options) >= 2, message
    for option in options:  # every value the message offers starts (the last of its keys wins)
        if "=null" not in option[0]:
            plan(DIGITS, [*overrides, *option], processes)


def test_explicit_micro_batch_without_updates_per_epoch_takes_its_own_updates():
    # 48 transitions: not a multiple of 9 steps, so PPO-clip's samples are split into single-step records
    (_, _, _, _, micro), banner = plan(DIGITS, ["train.micro_batch=48", "train.updates_per_epoch=null"])
    assert (micro.transitions, micro.records, micro.split_samples, micro.updates) == (48, 48, True, 6)
    assert "6 optimizer update(s) per rollout" in banner
    assert "micro-batch: 48 transitions (samples of 9 steps split into single-step records)" in banner


def test_the_gpu_configs_check_their_updates_per_rollout_on_another_number_of_gpus():
    # configs/flux_flow_grpo.yaml is sized for 32 GPUs (2 updates per rollout); on 8 without a new grad_accum it used
    # to make 8 updates silently, now the error names the value that keeps 2 (docs/guides/real-models.md's FLUX command passes it)
    flux = ROOT / "configs" / "flux_flow_grpo.yaml"
    with pytest.raises(ValueError, match=r"make 8 optimizer update\(s\).*but train.updates_per_epoch=2: use "
                                         r"train.grad_accum=24 \(with train.micro_batch=15\)"):
        plan(flux, [], 8)
    (_, _, _, _, micro), _ = plan(flux, ["train.grad_accum=24"], 8)
    assert micro.updates == 2 and micro.records == 3


def test_auto_runs_like_the_explicit_micro_batch_it_resolves_to(tmp_path):
    # one process, 8 samples x 3 steps, a stale rollout copy (the proximal recompute runs in micro-batches too):
    # auto with 2 micro-batches per update = 4 samples = 12 transitions, bit for bit
    from difrl.train.flow.trainer import TIMING_KEYS, train

    tiny = ["seed=3", "threads=1", "sampler.num_steps=4", "rollout.prompts_per_iter=2", "rollout.group_size=4",
            "train.grad_accum=2", "train.iterations=2", "train.lr=1e-3", "train.clip_low=1e-3", "train.clip_high=1e-3",
            "rollout.sync_every=2", "correct.method=token_tis", "eval.every=0", "eval.per_digit=1", "eval.num_steps=2"]
    runs = {}
    for name, mb in (("auto", "auto"), ("explicit", "12")):
        train(load_flow_config(None, [*tiny, f"train.micro_batch={mb}"]), out_dir=tmp_path / name)
        rows = [json.loads(ln) for ln in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        runs[name] = [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]
    assert runs["auto"] == runs["explicit"] and len(runs["auto"]) == 2
    assert "correct/ess_frac" in runs["auto"][0]


def test_thread_note_only_when_other_processes_keep_the_cores_busy(monkeypatch):
    monkeypatch.setattr(flow_plan.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(flow_plan.torch, "get_num_threads", lambda: 2)
    for load, threads_set, noted in ((1.9, False, True), (0.3, False, False), (1.9, True, False)):
        monkeypatch.setattr(flow_plan.os, "getloadavg", lambda load=load: (load, load, load))
        assert bool(flow_plan.thread_note(threads_set)) == noted, (load, threads_set)
    monkeypatch.setattr(flow_plan.torch, "get_num_threads", lambda: 1)
    assert flow_plan.thread_note(False) == ""  # one thread per process waits for no other


def test_the_masked_trainer_takes_the_flow_trainers_micro_batch_keys():
    # the masked trainer is data-parallel like the flow trainer (difrl/train/masked/plan.py), with the same keys in
    # sequences: micro_batch auto keeps train.updates_per_epoch whatever the process count (tests/test_masked_dp.py)
    from difrl.config import ConfigError
    from difrl.train.recipes import load_train_config

    cfg = load_train_config(ROOT / "configs" / "sudoku.yaml", [])
    assert (cfg.train.micro_batch, cfg.train.updates_per_epoch) == ("auto", 2)
    cfg = load_train_config(ROOT / "configs" / "sudoku.yaml", ["train.micro_batch=32", "train.updates_per_epoch=null"])
    assert (cfg.train.micro_batch, cfg.train.updates_per_epoch) == (32, None)
    with pytest.raises(ConfigError, match="train.updates_per_epoch"):
        load_train_config(ROOT / "configs" / "sudoku.yaml", ["train.updates_per_epoch=0"])

"""Options a configuration would silently ignore are config errors, and the reward-failure counters survive a
stop and resume without counting the failing iteration twice.

    .venv/bin/python -m pytest tests/test_ignored_options.py -q

A key counts as set when its value differs from its section's default (so a saved config.yaml, which lists
every key, still loads); every shipped config loads.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from difrl.config import ConfigError
from difrl.rewards import RewardError
from difrl.train.config import load_flow_config
from difrl.train.recipes import load_train_config
from difrl.train.masked.config import load_masked_config
from difrl.train.reward_stage import track_reward_failures

ROOT = Path(__file__).resolve().parent.parent
TREE = ["rollout.kind=tree", "rollout.group_size=4", "tree.split_steps=[0,1]", "sampler.num_steps=4"]


@pytest.mark.parametrize("override", ["train.kl_beta=0.1", "train.clip_low=1e-3", "train.clip_high=2e-4",
                                      "train.kl_form=exact"])
def test_grpo_keys_under_nft_are_errors(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"'{key}' \(command line\).*would be ignored.*objective=nft.*nft.ref_beta"):
        load_flow_config(None, ["train.objective=nft", override])
    load_flow_config(None, [override, "train.kl_beta=0.1"])  # under GRPO the key is read (kl_form: with a KL term)
    # at its default the key changes nothing: accepted (a saved config.yaml lists every key)
    load_flow_config(None, ["train.objective=nft", "train.kl_beta=0", "train.clip_low=1e-4", "train.kl_form=flow_grpo"])


def test_a_grpo_yaml_switched_to_nft_names_the_yaml_key(tmp_path):
    with pytest.raises(ConfigError, match=r"'train.kl_beta' \(in .*digits.yaml\).*would be ignored"):
        load_flow_config(ROOT / "configs" / "digits.yaml", ["train.objective=nft"])
    load_flow_config(ROOT / "configs" / "digits.yaml", ["train.objective=nft", "train.kl_beta=0", "train.clip_low=1e-4",
                                                        "train.clip_high=1e-4"])


def test_chunks_with_a_tree_rollout_is_an_error():
    with pytest.raises(ConfigError, match=r"'rollout.chunks'.*= 2 would be ignored.*tree"):
        load_flow_config(None, [*TREE, "rollout.chunks=2"])
    load_flow_config(None, TREE)
    load_flow_config(None, ["rollout.chunks=2"])  # flat rollouts sample in chunks


def test_reward_overlap_in_the_masked_trainer_is_an_error():
    with pytest.raises(ConfigError, match=r"'reward.overlap'.*nothing to overlap"):
        load_masked_config(None, ["reward.overlap=true"])
    load_masked_config(None, ["reward.overlap=false"])


@pytest.mark.parametrize("kind", ["sudoku", "digit_tokens"])
@pytest.mark.parametrize("override", ["model.task=countdown", "model.problems=/x.jsonl", "model.gen_length=8",
                                      "model.chat_template=false", "model.trust_remote_code=true", "model.dtype=bf16",
                                      "model.gradient_checkpointing=true", "model.mask_id=3", "eval.problems=/x.jsonl",
                                      "eval.samples=16", "eval.pass_k=[1]"])
def test_hf_masked_keys_on_other_masked_worlds_are_errors(kind, override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"'{key}'.*model.kind=hf_masked.*ignored by model.kind={kind}"):
        load_masked_config(None, [f"model.kind={kind}", override])


def test_every_hf_masked_key_is_checked():
    # a key added to the hf_masked world must be added to its OWN_KEYS (its help says "hf_masked:")
    from difrl.train.masked.config import MaskedEvalConfig, MaskedModelConfig
    from difrl.worlds.text_tasks import OWN_KEYS

    def hf_only(cls):
        from dataclasses import fields

        return {f.name for f in fields(cls) if f.metadata.get("help", "").startswith("hf_masked:")}

    assert hf_only(MaskedModelConfig) == set(OWN_KEYS["model"])
    assert hf_only(MaskedEvalConfig) == set(OWN_KEYS["eval"])


@pytest.mark.parametrize("kind", ["digit_tokens", "hf_masked"])
@pytest.mark.parametrize("override", ["rollout.num_blanks=[2,3]", "eval.num_blanks=6"])
def test_sudoku_keys_on_other_masked_worlds_are_errors(kind, override):
    # the Sudoku world declares them as its own (difrl/worlds/sudoku.py OWN_KEYS); set elsewhere they would be ignored
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"'{key}'.*model.kind=sudoku.*ignored by model.kind={kind}"):
        load_masked_config(None, [f"model.kind={kind}", override])
    load_masked_config(None, ["model.kind=sudoku", override])  # the world that reads them takes them


def test_every_shipped_config_loads():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        load_train_config(path)


def test_a_stopping_iteration_is_not_counted_before_its_checkpoint():
    # stop() saves the checkpoint of the iteration before the failing one; a resume redoes the failing one and
    # counts it then, so the state stop() saves must hold none of its counts
    state = {"reward_failed": 1, "reward_scored": 8}
    saved = []
    with pytest.raises(RewardError, match=r"3 of 16 samples \(18.8%\) failed so far"):
        track_reward_failures(state, 2, 8, 0.1, "iteration 1", lambda: saved.append(dict(state)), Path("run"))
    assert saved == [{"reward_failed": 1, "reward_scored": 8}] and state == saved[0]
    # the resumed run redoes iteration 1 with one failure: counted once
    assert track_reward_failures(state, 1, 8, 0.2, "iteration 1", lambda: None, Path("run")) == 2 / 16
    assert state == {"reward_failed": 2, "reward_scored": 16}


@pytest.mark.parametrize("overrides, key, why", [
    (["tree.rounds=3"], "tree.rounds", "rollout.kind=flat"),
    (["rollout.kind=solrl", "rollout.group_size=4", "tree.factor=4"], "tree.factor", "rollout.kind=solrl"),
    (["train.policy_loss=gspo", "train.clip_low=1e-3"], "train.clip_low", "train.policy_loss=gspo"),
    (["train.policy_loss=vespo", "train.clip_high=1e-3"], "train.clip_high", "train.policy_loss=vespo"),
    (["train.kl_form=exact"], "train.kl_form", "train.kl_beta=0"),
    (["sampler.cps_log_prob=flow_grpo"], "sampler.cps_log_prob", "sampler.kind=flow_sde"),
])
def test_keys_this_configuration_ignores_are_errors(overrides, key, why):
    with pytest.raises(ConfigError, match=rf"'{key}' \(command line\).*would be ignored: {why}"):
        load_flow_config(None, overrides)


def test_the_configurations_that_read_those_keys_take_them():
    load_flow_config(None, [*TREE, "tree.noise_scale=2.0"])
    load_flow_config(None, ["train.kl_beta=0.1", "train.kl_form=exact"])
    load_flow_config(None, ["sampler.kind=cps", "sampler.cps_log_prob=flow_grpo"])
    load_flow_config(None, ["train.policy_loss=gspo", "train.policy_loss_options={eps_low: 3e-4}"])


@pytest.mark.parametrize("override, key, near", [("reward.weights={digit_prb: 1.0}", "reward.weights.digit_prb", "digit_prob"),
                                                ("eval.rewards={hpsv: {}}", "eval.rewards.hpsv", "hpsv2")])
def test_an_unknown_reward_is_a_located_error_with_a_near_miss(override, key, near):
    with pytest.raises(ConfigError, match=rf"'{key}' \(command line\).*unknown reward.*did you mean '{near}'\?"):
        load_flow_config(None, [override])
    load_flow_config(None, ["reward.weights={my_mod:my_reward: 1.0}"])  # module:function: imported when built


def test_an_error_names_where_its_key_came_from():
    # external.source set on the command line with no external.path: the key set is named, not the YAML file
    with pytest.raises(ConfigError, match=r"'external.source' \(command line\).*needs external.path"):
        load_masked_config(ROOT / "configs" / "sudoku.yaml", ["external.source=checkpoint"])
    # a key at its default is said to be one, not to come from the file that never mentions it
    with pytest.raises(ConfigError, match=r"'steps.window_start' \(default value\)"):
        load_flow_config(ROOT / "configs" / "digits.yaml", ["steps.mode=fixed_window", "steps.window_size=10"])

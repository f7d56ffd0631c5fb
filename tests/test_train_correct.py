"""The corrector core wired into the flow trainer, with a rollout/train mismatch injected by rounding the
rollout copy's format (difrl.quant).

    pytest tests/test_train_correct.py -q
"""

import json

import pytest
from difrl.config import ConfigError
from difrl.models.digits import DigitsPolicy
from difrl.train.config import load_flow_config
from difrl.train.flow import train

TINY = ["seed=3", "sampler.num_steps=4", "rollout.prompts_per_iter=2", "rollout.group_size=4", "train.micro_batch=2",
        "train.grad_accum=2", "train.iterations=2", "eval.every=0", "eval.per_digit=3", "eval.num_steps=3"]


def rows(run_dir):
    return [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_mismatch_is_measured_and_the_proximal_policy_keeps_ratio_one(tmp_path):
    train(load_flow_config(None, [*TINY, "rollout.precision=fp8"]), out_dir=tmp_path)
    for r in rows(tmp_path):
        assert r["first_step_max_abs_log_ratio"] <= 1e-6  # PPO's old policy is the recomputed proximal one
        assert r["correct/mean_log_ratio"] != 0.0 and r["correct/kl_k3"] >= 0.0  # the fp8 copy is a different policy
        assert r["correct/ess_frac"] == 1.0 and r["correct/masked_frac"] == 0.0  # method none: weights 1


def test_a_corrector_masks_and_weights_in_the_trainer(tmp_path):
    band = "correct.options={low: 0.99999, high: 1.00001}"
    train(load_flow_config(None, [*TINY, "rollout.precision=fp8", "correct.method=token_mis", band]),
          out_dir=tmp_path / "mis")
    assert all(r["correct/masked_frac"] > 0 for r in rows(tmp_path / "mis"))
    train(load_flow_config(None, [*TINY, "rollout.precision=bf16", "correct.method=ais"]), out_dir=tmp_path / "ais")
    assert all("correct/ais_lambda" in r for r in rows(tmp_path / "ais"))


def test_unknown_corrector_option_is_named():
    with pytest.raises(ConfigError, match=r"correct.options.capp.*token_tis takes \['cap'\]"):
        load_flow_config(None, ["rollout.precision=bf16", "correct.method=token_tis", "correct.options={capp: 2}"])
    with pytest.raises(ConfigError, match="correct.method"):
        load_flow_config(None, ["correct.method=vespo"])
    with pytest.raises(ConfigError, match="rollout.sync_every=1\\): every weight would be 1"):
        load_flow_config(None, ["correct.method=ais"])

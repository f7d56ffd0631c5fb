"""The corrector core wired into the flow trainer, with a rollout/train mismatch injected by rounding the
rollout copy's format (difrl.quant): every selectable corrector's weights reach the gradient, and the
new correctors and policy losses run in the trainer.

    pytest tests/test_train_correct.py -q
"""

import json
import math

import pytest
import torch
from difrl.config import ConfigError
from difrl.correct import METHODS
from difrl.models.digits import DigitsPolicy
from difrl.quant import QUANT_PRESETS, RolloutCopy
from difrl.rollout import rollout
from difrl.samplers import sigma_schedule
from difrl.train.flow import objectives
from difrl.train.config import load_flow_config
from difrl.train.flow.trainer import train
from difrl.train.metrics import Metrics
from tolerances import FLOW_FIRST_STEP_LOG_RATIO

TINY = ["seed=3", "sampler.num_steps=4", "rollout.prompts_per_iter=2", "rollout.group_size=4", "train.micro_batch=6",
        "train.grad_accum=2", "train.iterations=2", "eval.every=0", "eval.per_digit=3", "eval.num_steps=3"]


def rows(run_dir):
    return [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_mismatch_is_measured_and_the_proximal_policy_keeps_ratio_one(tmp_path):
    train(load_flow_config(None, [*TINY, "rollout.precision=fp8"]), out_dir=tmp_path)
    for r in rows(tmp_path):
        assert r["first_step_max_abs_log_ratio"] <= FLOW_FIRST_STEP_LOG_RATIO  # PPO's old policy: the recomputed one
        assert r["correct/mean_log_ratio"] != 0.0 and r["correct/kl_k3"] > 0.0  # the fp8 copy is a different policy
        assert r["correct/ess_frac"] == 1.0 and r["correct/masked_frac"] == 0.0  # method none: weights 1


def test_a_corrector_masks_and_weights_in_the_trainer(tmp_path):
    band = "correct.options={low: 0.99999, high: 1.00001}"
    train(load_flow_config(None, [*TINY, "rollout.precision=fp8", "correct.method=token_mis", band]),
          out_dir=tmp_path / "mis")
    assert all(r["correct/masked_frac"] > 0 for r in rows(tmp_path / "mis"))
    train(load_flow_config(None, [*TINY, "rollout.precision=bf16", "correct.method=ais"]), out_dir=tmp_path / "ais")
    # AIS's mixing weight is 1 - exp(-K3 / kl_scale) of the measured mismatch (kl_scale 1e-3); the logged K3 is an fp32
    # mean of small per-token values, which keeps ~1e-3 of itself (the relative tolerance)
    for r in rows(tmp_path / "ais"):
        assert r["correct/kl_k3"] > 0 and r["correct/ais_lambda"] == pytest.approx(1 - math.exp(-r["correct/kl_k3"] / 1e-3),
                                                                                  rel=1e-3, abs=1e-7)


def test_unknown_corrector_option_is_named():
    with pytest.raises(ConfigError, match=r"correct.options.capp.*token_tis takes \['cap'\]"):
        load_flow_config(None, ["rollout.precision=bf16", "correct.method=token_tis", "correct.options={capp: 2}"])
    with pytest.raises(ConfigError, match="correct.method"):
        load_flow_config(None, ["correct.method=vespo"])
    with pytest.raises(ConfigError, match="rollout.sync_every=1\\): every weight would be 1"):
        load_flow_config(None, ["correct.method=ais"])


# ---------------------------------------------------------------------------------- the weights reach the loss

# options under which each corrector's effective weight (weight x keep) is not 1 on an fp8 copy's transitions
BITE = {"none": None, "token_tis": {}, "token_tis_bn": {}, "token_mis": {}, "seq_tis": {}, "seq_tis_bn": {},
        "seq_mis": {}, "geo_rs": {"low": 1 - 1e-9, "high": 1 + 1e-9}, "k2_rs": {"threshold": 1e-12},
        "k3_rs": {"threshold": 1e-12, "aggregate": "token"}, "minpro": {}, "ais": {"kl_scale": 1e-12}}


def _fp8_copy_batch():
    from difrl.models.digits import digit_prompt

    cfg = load_flow_config(None, [*TINY, "rollout.precision=fp8", "train.lora.enabled=false"])
    policy = DigitsPolicy.from_checkpoint()
    rc = RolloutCopy(policy.module, "fp8", **QUANT_PRESETS["digits"])
    mask = torch.tensor([True, True, True, False])
    with rc.active(policy):
        batch = rollout(policy, [digit_prompt(d) for d in (0, 1, 2, 3)], torch.arange(4), sigma_schedule(4),
                        cfg.sampler.kind, cfg.sampler.kernel_kwargs(), mask, mask)
    mu = batch.log_prob_old.clone()
    batch, _ = objectives.proximal_correction(policy, batch, cfg)
    return cfg, policy, batch, mu


def _grad(cfg, policy, batch, correction):
    policy.module.zero_grad(set_to_none=True)
    adv = torch.tensor([1.0, -0.5, 0.25, -1.0])
    loss = objectives.grpo_micro_loss(policy, batch, adv, torch.ones(4), correction, Metrics(4), False, 12, cfg, None)
    loss.backward()
    return torch.cat([p.grad.flatten() for p in policy.module.parameters() if p.grad is not None])


def test_every_selectable_corrector_reaches_the_gradient():
    """Gradient with a corrector != without it when its effective weights are not all 1, and == when they are
    (log_prob_rollout = pi_old: every weight 1), through the trainer's own GRPO loss."""
    cfg, policy, batch, mu = _fp8_copy_batch()
    plain = _grad(cfg, policy, batch, None)
    assert sorted(BITE) == sorted(METHODS)
    for name, options in BITE.items():
        ones = METHODS[name](batch.log_prob_old, batch.log_prob_old.clone(), None, **(options or {}))
        # exact: x 1 changes no bit
        assert torch.equal(_grad(cfg, policy, batch, (ones.weights, ones.keep)), plain), name
        if options is None:  # `none`: weights 1 whatever the mismatch
            continue
        c = METHODS[name](batch.log_prob_old, mu, None, **options)
        effective = c.weights * c.keep
        assert not torch.equal(effective, torch.ones_like(effective)), name  # the precondition: weights bite
        g = _grad(cfg, policy, batch, (c.weights, c.keep))
        assert not torch.allclose(g, plain, rtol=1e-6, atol=1e-9), name


@pytest.mark.slow
@pytest.mark.parametrize("method, options, loss", [
    ("token_tis_bn", "{cap: 2.0}", "gspo"),
    ("seq_tis_bn", "{}", "ctpo"),
    ("k3_rs", "{threshold: 1e-12, aggregate: token}", "aspo"),
    ("k3_rs", "{threshold: 1e-12, aggregate: max}", "vespo"),
])
def test_new_correctors_and_policy_losses_train_one_iteration(tmp_path, method, options, loss):
    cfg = load_flow_config(None, [*TINY, "train.iterations=1", "rollout.precision=fp8", f"correct.method={method}",
                                  f"correct.options={options}", f"train.policy_loss={loss}"])
    summary = train(cfg, out_dir=tmp_path)
    (r,) = rows(tmp_path)
    assert summary["iterations"] == 1 and r["first_step_policy_max_abs_log_ratio"] <= FLOW_FIRST_STEP_LOG_RATIO
    assert "clip_high" not in r and "approx_kl" in r  # the chosen loss ran, not PPO-clip
    assert (r["grad_norm"] > 0) == (r["correct/masked_frac"] < 1.0)  # a gradient unless every step was rejected
    if method == "k3_rs":  # the K3 of an fp8 copy's steps is above 1e-12 almost everywhere
        assert r["correct/masked_frac"] > 0.5
    else:
        assert r["correct/batch_mean_weight"] > 0 and r["correct/masked_frac"] == 0.0


def test_new_corrector_and_loss_options_are_checked():
    with pytest.raises(ConfigError, match=r"correct.options.aggregate.*expected one of token, sum, mean, max"):
        load_flow_config(None, ["rollout.precision=bf16", "correct.method=k3_rs", "correct.options={aggregate: all}"])
    with pytest.raises(ConfigError, match=r"correct.options.cap.*expected > 0"):
        load_flow_config(None, ["rollout.precision=bf16", "correct.method=token_tis_bn", "correct.options={cap: 0}"])
    with pytest.raises(ConfigError, match=r"train.policy_loss_options.eps.*gspo takes \['eps_low', 'eps_high'\]"):
        load_flow_config(None, ["train.policy_loss=gspo", "train.policy_loss_options={eps: 0.1}"])
    with pytest.raises(ConfigError, match=r"train.policy_loss.*needs train.objective=grpo"):
        load_flow_config(None, ["train.policy_loss=ctpo", "train.objective=nft", "rollout.kind=flat"])
    with pytest.raises(ConfigError, match="ppo_clip takes none"):
        load_flow_config(None, ["train.policy_loss_options={eps_low: 0.1}"])

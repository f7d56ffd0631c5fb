"""AWM, online Diffusion-DPO, DGPO and Flow-DPPO (docs/guides/methods.md): their formulas on tiny tensors, their config
errors, and the flow trainer's invariants with train.objective set to each (tiny digits runs, a few seconds each).

    PYTHONPATH=. .venv/bin/python -m pytest tests/test_methods.py -q
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from difrl.algos.dppo import dppo_loss, transition_kl
from difrl.algos.matching import awm_loss, awm_weighting, dgpo_coefficients, dpo_coefficients, matching_error
from difrl.config import ConfigError
from difrl.train.config import load_flow_config
from difrl.train.flow.trainer import TIMING_KEYS, train
from difrl.utils.io import load_safetensors_checked
from tolerances import FLOW_FIRST_STEP_LOG_RATIO

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("awm", "dpo", "dgpo", "dppo")

# ------------------------------------------------------------------------- formulas


def test_awm_with_all_advantages_one_is_the_flow_matching_loss():
    g = torch.Generator().manual_seed(0)
    v, x0, eps = (torch.randn(5, 2, 3, 3, generator=g) for _ in range(3))
    sigma = torch.rand(5, generator=g)
    per, m = awm_loss(v, x0, eps, sigma, torch.ones(5), "uniform")
    plain = ((v - (eps - x0)) ** 2).mean(dim=(1, 2, 3))  # the pretraining loss, written out
    torch.testing.assert_close(per, plain, rtol=1e-6, atol=0)  # fp32 summation order only
    torch.testing.assert_close(m["matching_error"], plain, rtol=1e-6, atol=0)
    # the weightings on hand values: l = 0.5 at sigma = 0.4 (ghuber p = 0.5: 0.4 (sqrt(0.5 + 1e-10) - 1e-5) / 0.5)
    l, s = torch.tensor([0.5]), torch.tensor([0.4])
    assert awm_weighting(l, s, "t").item() == pytest.approx(0.2, rel=1e-6)  # fp32 against float64: a few ulp
    assert awm_weighting(l, s, "ghuber", 0.5).item() == pytest.approx(0.4 * (math.sqrt(0.5 + 1e-10) - 1e-5) / 0.5, rel=1e-6)
    # an advantage scales the loss: A = -2 gives -2 x the plain loss (a bad sample's error is pushed up)
    torch.testing.assert_close(awm_loss(v, x0, eps, sigma, torch.full((5,), -2.0))[0], -2 * plain, rtol=1e-6, atol=0)


def test_awm_gradient_is_the_reference_ratio_form_on_the_first_step():
    # the reference trains -A exp(-(w - w_old)) with w_old the detached own value on the on-policy step (ratio 1):
    # its gradient is A grad w, which is what awm_loss trains
    g = torch.Generator().manual_seed(1)
    x0, eps = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    sigma, adv = torch.rand(4, generator=g), torch.tensor([1.5, -0.5, 0.2, -1.0])
    v1 = torch.randn(4, 6, generator=g).requires_grad_()
    v2 = v1.detach().clone().requires_grad_()
    awm_loss(v1, x0, eps, sigma, adv, "ghuber", 0.25)[0].sum().backward()
    w = awm_weighting(matching_error(v2, x0, eps), sigma, "ghuber", 0.25)
    ratio = torch.exp(-(w - w.detach()))
    assert torch.equal(ratio.detach(), torch.ones(4))  # exact: w - w.detach() is 0, exp(0) is 1
    (-adv * ratio).sum().backward()
    torch.testing.assert_close(v1.grad, v2.grad, rtol=1e-5, atol=1e-7)  # the same value computed two ways in fp32


def test_dpo_pair_loss_sign_and_gradient_direction():
    # one group of three: the best (A = 1) and the worst (A = -1) form the pair; the middle sample gets nothing
    beta = 10.0
    l = torch.tensor([[0.30], [0.50], [0.40]], requires_grad=True)  # policy matching errors [B, T=1]
    l_ref = torch.tensor([[0.35], [0.50], [0.38]])
    adv, groups = torch.tensor([1.0, 0.0, -1.0]), torch.tensor([7, 7, 7])
    coef, loss, m = dpo_coefficients((l - l_ref).detach(), groups, adv, beta)
    z = beta * ((0.30 - 0.35) - (0.40 - 0.38))  # = -0.7: the winner already fits better than the reference does
    assert loss.item() == pytest.approx(math.log1p(math.exp(z)), rel=1e-5)  # -log sigmoid(-z); fp32 vs float64
    assert loss.item() < math.log(2)  # below the indifferent pair's loss
    assert m["dpo_margin"].item() == pytest.approx(-z / beta, rel=1e-5) and m["dpo_accuracy"].item() == 1.0
    # the coefficients are the gradient of the pair loss with respect to the matching errors
    F.softplus(beta * ((l[0] - l_ref[0]) - (l[2] - l_ref[2]))).sum().backward()
    torch.testing.assert_close(coef, l.grad, rtol=1e-6, atol=0)  # closed form vs autograd: fp32, a few ulp
    # gradient descent lowers the winner's error and raises the loser's
    assert coef[0].item() > 0 and coef[2].item() < 0 and coef[1].item() == 0
    # a tied group, or a group with a dropped sample, has no pair
    coef_tied, loss_tied, _ = dpo_coefficients((l - l_ref).detach(), groups, torch.zeros(3), beta)
    assert torch.equal(coef_tied, torch.zeros(3, 1)) and loss_tied.numel() == 0  # exact: dropped pairs are set to 0
    coef_drop, _, _ = dpo_coefficients((l - l_ref).detach(), groups, adv, beta, torch.tensor([True, True, False]))
    assert torch.equal(coef_drop, torch.zeros(3, 1))


def test_dgpo_coefficients_are_the_group_loss_gradient_without_beta_over_g():
    beta = 4.0
    l = torch.tensor([[0.2, 0.3], [0.6, 0.1], [0.4, 0.4], [0.5, 0.2]], requires_grad=True)  # [B=4, T=2]
    l_ref = torch.tensor([[0.25, 0.3], [0.5, 0.2], [0.4, 0.5], [0.45, 0.1]])
    adv, groups = torch.tensor([1.2, -0.8, 0.5, -0.9]), torch.tensor([3, 3, 9, 9])
    coef, loss, m = dgpo_coefficients((l - l_ref).detach(), groups, adv, beta)
    # the group preference loss written out: softplus((beta / G) sum_i A_i (l_i - l_i,ref)), G = 2, per sigma
    s = torch.stack([(beta / 2) * (adv[i:i + 2, None] * (l[i:i + 2] - l_ref[i:i + 2])).sum(0) for i in (0, 2)])
    torch.testing.assert_close(loss, F.softplus(s).detach(), rtol=1e-6, atol=0)  # another op order: fp32 ulps
    F.softplus(s).sum().backward()
    torch.testing.assert_close(coef * beta / 2, l.grad, rtol=1e-6, atol=1e-8)  # the reference drops beta / G
    # direction: the positive sample's error is pushed down, the negative one's up
    assert (coef[0] > 0).all() and (coef[1] < 0).all()
    assert m["dgpo_group_weight"].shape == (4,)  # 2 groups x 2 sigmas
    coef_drop, _, _ = dgpo_coefficients((l - l_ref).detach(), groups, adv, beta, torch.tensor([True, False, True, True]))
    assert torch.equal(coef_drop[:2], torch.zeros(2, 2)) and torch.equal(coef_drop[2:], coef[2:])


def test_dppo_trust_region_is_the_exact_gaussian_kl():
    g = torch.Generator().manual_seed(2)
    mean_old, mean = torch.randn(6, 4, 3, generator=g), torch.randn(6, 4, 3, generator=g)
    std = torch.rand(6, generator=g) + 0.1
    kl = transition_kl(mean, mean_old, std)
    # torch's closed-form KL of two Gaussians, independently: KL(N(mu_old, std) || N(mu, std)), element mean
    s = std[:, None, None].expand_as(mean)
    ref = torch.distributions.kl_divergence(torch.distributions.Normal(mean_old, s), torch.distributions.Normal(mean, s))
    torch.testing.assert_close(kl, ref.mean(dim=(1, 2)), rtol=1e-5, atol=1e-7)  # two fp32 evaluations of one formula


def test_dppo_first_step_and_the_mask():
    # on-policy (new == old): ratio 1, KL 0, nothing masked, the loss is -A and its gradient GRPO's unclipped one
    b, T = 4, 2
    g = torch.Generator().manual_seed(3)
    lp_old, mean_old = torch.randn(b, T, generator=g), torch.randn(b, T, 5, generator=g)
    std, adv = torch.full((b, T), 0.5), torch.tensor([1.0, -1.0, 2.0, -0.5])
    lp = lp_old.clone().requires_grad_()
    pg, m = dppo_loss(lp, lp_old, mean_old.clone(), mean_old, std, adv, threshold=1e-5)
    # exact: lp and mean are copies of the old ones, so every difference is 0 and exp(0) = 1
    assert torch.equal(m["ratio"], torch.ones(b, T)) and torch.equal(m["trust_kl"], torch.zeros(b, T))
    assert m["trust_masked"].sum() == 0
    torch.testing.assert_close(pg, -adv[:, None].expand(b, T), rtol=0, atol=0)
    pg.sum().backward()
    torch.testing.assert_close(lp.grad, -adv[:, None].expand(b, T), rtol=0, atol=0)
    # far from old (KL >= threshold): dropped only where the step pushes further in the advantage's direction
    mean = mean_old + 1.0  # KL = 1 / (2 * 0.25) = 2 per element
    lp_new = lp_old + torch.tensor([[0.1, -0.1], [0.1, -0.1], [0.1, -0.1], [0.1, -0.1]])  # ratio > 1, < 1
    pg, m = dppo_loss(lp_new, lp_old, mean, mean_old, std, adv, threshold=1e-5)
    torch.testing.assert_close(m["trust_kl"], torch.full((b, T), 2.0), rtol=1e-6, atol=0)  # (m + 1) - m: 1 to an ulp
    expect = torch.tensor([[1, 0], [0, 1], [1, 0], [0, 1]], dtype=torch.float32)  # A > 0 & ratio > 1, A < 0 & ratio < 1
    assert torch.equal(m["trust_masked"], expect)  # 0/1 flags: exact
    assert torch.equal(pg == 0, expect.bool())
    # below the threshold nothing is dropped
    assert dppo_loss(lp_new, lp_old, mean, mean_old, std, adv, threshold=3.0)[1]["trust_masked"].sum() == 0


# ------------------------------------------------------------------------- config


@pytest.mark.parametrize("overrides,key", [
    (["train.objective=awm", "rollout.precision=nvfp4"], "rollout.precision"),
    (["train.objective=dgpo", "rollout.sync_every=2"], "rollout.sync_every"),
    (["train.objective=dpo", "rollout.precision=nvfp4", "correct.method=token_tis"], "correct.method"),
    (["train.objective=awm", "rollout.kind=tree", "tree.split_steps=[0,2]", "rollout.group_size=4"], "rollout.kind"),
    (["train.objective=dppo", "rollout.kind=tree", "tree.split_steps=[0,2]", "rollout.group_size=4"], "rollout.kind"),
    (["train.objective=awm", "train.clip_low=0.1"], "train.clip_low"),
    (["train.objective=dgpo", "train.kl_beta=0.1", "train.kl_form=exact"], "train.kl_form"),
    (["train.objective=dppo", "train.clip_high=0.1"], "train.clip_high"),
    (["train.objective=dppo", "train.ratio_norm=true"], "train.objective"),
    (["train.objective=awm", "train.step_weight=inverse_dt"], "train.objective"),
    (["train.objective=dppo", "train.policy_loss=gspo"], "train.policy_loss"),
    (["awm.weighting=t"], "awm.weighting"),  # a method's section under another objective
    (["train.objective=dpo", "dgpo.beta=10"], "dgpo.beta"),
    (["train.objective=dppo", "matching.timestep_fraction=0.5"], "matching.timestep_fraction"),
    (["train.objective=awm", "dppo.kl_threshold=0.1"], "dppo.kl_threshold"),
])
def test_settings_that_do_not_apply_are_refused_by_key(overrides, key):
    with pytest.raises(ConfigError, match=rf"'?{key}'?"):
        load_flow_config(None, overrides)


def test_method_configs_load_and_name_their_command():
    for method in METHODS:
        path = ROOT / "configs" / f"digits_{method}.yaml"
        cfg = load_flow_config(path)
        assert cfg.train.objective == method
        assert f"configs/digits_{method}.yaml" in path.read_text().splitlines()[0]


# ------------------------------------------------------------------------- the trainer

TINY = [
    "seed=3", "sampler.num_steps=4", "rollout.prompts_per_iter=2", "rollout.group_size=4", "train.iterations=1",
    "train.lr=1e-3", "eval.every=0", "eval.per_digit=3", "eval.num_steps=3",
]


def run(out: Path, *overrides: str) -> Path:
    train(load_flow_config(None, [*TINY, *overrides]), out_dir=out)
    return out


def metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def latest_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    return load_safetensors_checked(ckpt / "trainable.safetensors", "test")[0]


# transitions per iteration: 8 samples x T (dppo: 3 SDE steps of 4; the others: int(4 x 0.6) = 2 sigmas)
TRANSITIONS = {"awm": 16, "dpo": 16, "dgpo": 16, "dppo": 24}
SMALL = {"awm": 2, "dpo": 2, "dgpo": 2, "dppo": 3}  # one sample per micro-batch


@pytest.mark.parametrize("method", METHODS)
def test_accumulation_1x8_equals_8x1(tmp_path, method):
    # as tests/test_train.py: one update over the same 8 samples as 1 micro-batch or 8 accumulated ones; adam_eps = 1
    # makes Adam's first step ~ lr * g / (|g| + 1), so the weights compare the accumulated (and clipped) gradient.
    # The KL to the reference is on (for DPO / DGPO the reference is needed anyway).
    n, small = TRANSITIONS[method], SMALL[method]
    common = (f"train.objective={method}", "train.max_grad_norm=0.05", "train.kl_beta=0.2", "train.adam_eps=1.0",
              "train.lr=1.0", "train.weight_decay=0", *(["dpo.beta=20"] if method == "dpo" else []))
    a = run(tmp_path / "a", *common, f"train.micro_batch={n}", "train.grad_accum=1")
    b = run(tmp_path / "b", *common, f"train.micro_batch={small}", f"train.grad_accum={n // small}")
    init = run(tmp_path / "init", *common, f"train.micro_batch={n}", "train.iterations=0")
    wa, wb, w0 = latest_weights(a), latest_weights(b), latest_weights(init)
    assert wa.keys() == wb.keys()
    moved = 0.0
    for k in wa:
        delta_a, delta_b = wa[k] - w0[k], wb[k] - w0[k]
        moved = max(moved, float(delta_a.abs().max()))
        # fp32 sums in another order: relative 1e-4 of the largest move
        torch.testing.assert_close(delta_a, delta_b, rtol=1e-4, atol=1e-4 * float(delta_a.abs().max()) + 1e-12, msg=k)
    assert moved > 1e-4  # the update is not trivially zero
    ra, rb = metrics(a)[0], metrics(b)[0]
    for k in ("policy_loss", "loss", "grad_norm", "reward_mean"):
        assert ra[k] == pytest.approx(rb[k], rel=1e-5, abs=1e-7), k  # fp32 sums in another order (as above)


@pytest.mark.parametrize("method", METHODS)
def test_trains_on_digits_by_config_alone(tmp_path, method):
    # three iterations of two updates each from the method's own config file shrunk to the tiny run: the loss is
    # finite, every LoRA weight moves, and the method's own diagnostics are logged. DPPO: the first micro-step is
    # on-policy (ratio 1, nothing outside the trust region); its later updates leave it.
    cfg = load_flow_config(ROOT / "configs" / f"digits_{method}.yaml",
                           [*TINY, "train.iterations=3", "train.micro_batch=auto", "train.grad_accum=2",
                            "train.updates_per_epoch=2", "stop.fd_rise=null"])
    train(cfg, out_dir=tmp_path)
    rows = metrics(tmp_path)
    assert len(rows) == 3
    for r in rows:
        for k, v in r.items():
            if isinstance(v, float):
                assert math.isfinite(v), (k, v)
    w0, w = latest_weights_or_base(tmp_path)
    assert all(not torch.equal(w[k], w0[k]) for k in w if k.endswith("lora_B.default.weight")), "a LoRA B did not move"
    own = {"awm": "matching_error", "dpo": "dpo_margin", "dgpo": "dgpo_group_weight", "dppo": "trust_kl"}[method]
    assert own in rows[0]
    if method == "dppo":
        assert rows[0]["first_step_max_abs_log_ratio"] <= FLOW_FIRST_STEP_LOG_RATIO  # recomputed in micro-batches
        assert any(r["trust_kl"] > 0 for r in rows)  # the second update of a rollout is off its old policy
    if method == "awm":
        assert all(r["ema_kl"] > 0 for r in rows)  # the EMA anchor lags the trained weights (from the 2nd update on)
    if method in ("dpo", "dgpo"):  # the first pre-pass sees the policy equal to the reference: every delta 0
        assert rows[0]["policy_loss"] == pytest.approx(math.log(2), rel=1e-6)  # softplus(0); fp32 mean vs float64
        assert rows[1]["policy_loss"] != pytest.approx(math.log(2), rel=1e-6)


def test_matching_rollouts_are_ode_unless_sde_is_asked_for():
    from difrl.samplers import step_masks as sampler_step_masks
    from difrl.train.flow.plan import step_masks

    for method in ("awm", "dpo", "dgpo"):
        sde, trained, _ = step_masks(load_flow_config(None, [f"train.objective={method}"]), 0, 3)
        assert not sde.any() and not trained.any()  # deterministic rollouts storing no transition
        cfg = load_flow_config(None, [f"train.objective={method}", "matching.rollout=sde", "steps.mode=fixed_window",
                                      "steps.window_size=2", "steps.window_start=1"])
        sde, trained, _ = step_masks(cfg, 0, 3)
        assert torch.equal(sde, sampler_step_masks(cfg.steps, cfg.sampler.num_steps, cfg.seed, 0, 1)[0])
        assert sde.sum() == 2 and not trained.any()  # SDE exploration on the window, still nothing stored


def test_awm_resumes_exactly(tmp_path):
    # the EMA anchor (the "old" shadow) is in the checkpoint: 2 + 2 iterations equal 4
    extra = ["train.objective=awm", "train.lr=1e-2", "train.micro_batch=auto", "train.grad_accum=2"]
    train(load_flow_config(None, [*TINY, *extra, "train.iterations=4"]), out_dir=tmp_path / "full")
    train(load_flow_config(None, [*TINY, *extra, "train.iterations=2"]), out_dir=tmp_path / "part")
    train(load_flow_config(None, [*TINY, *extra, "train.iterations=4", f"resume={tmp_path / 'part'}"]))
    full, part = metrics(tmp_path / "full"), metrics(tmp_path / "part")
    assert full == part and full[-1]["ema_kl"] > 0


def latest_weights_or_base(run_dir: Path):
    """(initial LoRA weights: B = 0, the trained ones) of the run's final checkpoint."""
    w = latest_weights(run_dir)
    return {k: torch.zeros_like(v) if k.endswith("lora_B.default.weight") else v for k, v in w.items()}, w


# ------------------------------------------------------------------------- two processes


def _launch(out: Path, nproc: int, method: str, *overrides: str) -> None:
    """`difrl train configs/digits_<method>.yaml` on one process (in this one: tests/test_distributed.py's
    in_this_process) or a torchrun launch of `nproc`."""
    args = ["train", str(ROOT / "configs" / f"digits_{method}.yaml"), *overrides, "--out", str(out)]
    if nproc == 1:
        from test_distributed import in_this_process

        in_this_process(args)
        return
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "difrl",
           *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow  # two launches of two processes, tens of seconds: left out by `make test-fast`
@pytest.mark.parametrize("method", ["dgpo", "awm"])
def test_two_processes_equal_one(tmp_path, method):
    # one group of 8 split over the two processes: DGPO's group weight needs the other process's deltas (the
    # pre-pass gathers them); AWM's loss is per sample. One process accumulates 4 micro-batches of 2 samples x 2
    # sigmas, two processes 2 each and DDP averages: the same update up to float summation order.
    common = ["seed=3", "threads=1", "sampler.num_steps=4", "rollout.prompts_per_iter=1", "rollout.group_size=8",
              "train.micro_batch=4", "train.iterations=2", "train.adam_eps=1.0", "train.lr=1.0", "train.weight_decay=0",
              "train.kl_beta=0.1", "train.updates_per_epoch=null", "eval.every=0", "eval.per_digit=3", "eval.num_steps=3"]
    one, two = tmp_path / "one", tmp_path / "two"
    _launch(one, 1, method, *common, "train.grad_accum=4")
    _launch(two, 2, method, *common, "train.grad_accum=2")
    r1, r2 = metrics(one), metrics(two)
    assert len(r1) == len(r2) == 2
    own = {"dgpo": "dgpo_group_weight", "awm": "ema_kl"}[method]
    for a, b in zip(r1, r2):
        for k in ("reward_mean", "adv_std", "trained_samples"):  # gathered: the same values
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k
        for k in ("policy_loss", "kl", "grad_norm", "matching_error", own):  # means over processes: summation order
            assert a[k] == pytest.approx(b[k], rel=1e-3, abs=1e-7), k
    w1, w2 = latest_weights(one), latest_weights(two)
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], rtol=1e-3, atol=1e-6, msg=k)  # fp32 sums in another order
    assert any(float(w.abs().max()) > 1e-3 for k, w in w1.items() if "lora_B" in k)  # training moved B

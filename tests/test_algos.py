"""Advantages and losses (docs/reference/specs/flow-grpo-family.md §1, §2.7).

    pytest tests/test_algos.py -q
"""

import math

import pytest
import torch

from difrl.algos import gaussian_step_kl, group_advantages, group_normalize, ppo_clip_loss
from tolerances import FP32_REORDER  # the library's fp32 formula against the same math written out in another order


def test_group_normalize_by_group_id_not_position():
    r = torch.tensor([1.0, 5.0, 2.0, 6.0, 3.0, 7.0])
    g = torch.tensor([0, 1, 0, 1, 0, 1])  # interleaved groups
    adv, zero = group_normalize(r, g, eps=0.0, clip=None)
    z = torch.tensor([-1.0, 0.0, 1.0]) / math.sqrt(2.0 / 3.0)  # population std of (1, 2, 3)
    torch.testing.assert_close(adv[g == 0], z, **FP32_REORDER)
    torch.testing.assert_close(adv[g == 1], z, **FP32_REORDER)
    assert not zero.any()


def test_global_std_scope_uses_the_whole_batch():
    r = torch.tensor([0.0, 1.0, 10.0, 12.0])
    g = torch.tensor([0, 0, 1, 1])
    adv, _ = group_normalize(r, g, std_scope="global", eps=0.0, clip=None)
    std = r.std(unbiased=False)
    torch.testing.assert_close(adv, torch.tensor([-0.5, 0.5, -1.0, 1.0]) / std, **FP32_REORDER)
    with pytest.raises(ValueError, match="std_scope"):
        group_normalize(r, g, std_scope="batch")


def test_zero_spread_groups_are_flagged_and_zero():
    r = torch.tensor([0.3, 0.3, 0.3, 0.1, 0.9, 0.5])
    g = torch.tensor([0, 0, 0, 1, 1, 1])
    adv, zero = group_normalize(r, g)
    assert zero.tolist() == [True, True, True, False, False, False]
    assert torch.all(adv[:3] == 0)  # exact: a flagged group's advantages are set to 0, not computed


def test_eps_and_clip():
    r = torch.tensor([0.0, 0.0, 0.0, 1.0])  # one outlier: z = 1.73, with tiny std groups it explodes
    g = torch.zeros(4, dtype=torch.long)
    adv, _ = group_normalize(r, g, eps=0.0, clip=1.0)
    # exact 1.0: the clip's bound; the other is fp32 against the float64 closed form
    assert float(adv.max()) == 1.0 and float(adv.min()) == pytest.approx(-1 / math.sqrt(3), rel=1e-5)
    small, _ = group_normalize(r * 1e-6, g, eps=1e-4, clip=None)
    assert float(small.abs().max()) < 0.02  # eps keeps near-constant groups from being amplified


def test_multi_reward_aggregation():
    g = torch.tensor([0, 0, 1, 1])
    big = torch.tensor([10.0, 20.0, 10.0, 20.0])
    small = torch.tensor([0.02, 0.01, 0.01, 0.02])
    rs = group_advantages({"big": big, "small": small}, {"big": 1.0, "small": 1.0}, g, eps=0.0, clip=None)
    torch.testing.assert_close(rs.reward, big + small, **FP32_REORDER)
    assert rs.advantages.tolist() == pytest.approx([-1, 1, -1, 1], abs=1e-3)  # the small reward vanishes
    av = group_advantages({"big": big, "small": small}, {"big": 1.0, "small": 1.0}, g, aggregate="advantage_sum",
                          eps=0.0, clip=None)
    assert av.advantages.tolist() == pytest.approx([0, 0, -2, 2], abs=1e-5)  # both count equally (fp32 sums of O(1))
    with pytest.raises(KeyError, match="reward weights name"):
        group_advantages({"big": big}, {"big": 1.0, "clip": 1.0}, g)


def test_ppo_clip_loss_on_policy_gradient_is_minus_advantage():
    lp = torch.zeros(3, 2, requires_grad=True)
    adv = torch.tensor([1.0, -2.0, 0.5])
    loss, m = ppo_clip_loss(lp, lp.detach(), adv, 1e-3, 1e-3)
    loss.mean().backward()
    torch.testing.assert_close(lp.grad, -adv[:, None].expand(3, 2) / 6, **FP32_REORDER)
    # exact: log_prob_old is the same tensor, so lp - lp_old = 0 and exp(0) = 1 in any IEEE arithmetic
    assert torch.all(m["ratio"] == 1) and torch.all(m["approx_kl"] == 0)
    assert m["clip_high"].sum() == 0 and m["clip_low"].sum() == 0


def test_ppo_clip_loss_clips_asymmetrically():
    old = torch.zeros(4)
    lp = torch.log(torch.tensor([1.3, 1.3, 0.7, 0.7])).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, m = ppo_clip_loss(lp, old, adv, clip_low=0.2, clip_high=0.1)
    # A>0 above 1+0.1: clipped (no gradient); A<0 below 1-0.2: clipped; the other two are not
    torch.testing.assert_close(loss.detach(), torch.tensor([-1.1, 1.3, -0.7, 0.8]), **FP32_REORDER)
    loss.sum().backward()
    assert lp.grad[0] == 0 and lp.grad[3] == 0 and lp.grad[1] != 0 and lp.grad[2] != 0
    assert m["clip_high"].tolist() == [1, 0, 0, 0] and m["clip_low"].tolist() == [0, 0, 0, 1]
    torch.testing.assert_close(m["approx_kl"], 0.5 * lp.detach() ** 2, **FP32_REORDER)


def test_ppo_clip_loss_weights_and_per_step_advantages():
    lp = torch.zeros(2, 3)
    adv = torch.tensor([[1.0, 2.0, 3.0], [0.0, -1.0, 1.0]])
    w = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    loss, _ = ppo_clip_loss(lp, lp, adv, 0.1, 0.1, weight=w)
    torch.testing.assert_close(loss, -adv * w, **FP32_REORDER)


def test_gaussian_step_kl_exact_form_is_the_true_kl():
    torch.manual_seed(0)
    mu, mu_ref = torch.randn(5, 8), torch.randn(5, 8)
    std = torch.rand(5) + 0.1
    h = torch.rand(5) * 0.2 + 0.01
    kl = gaussian_step_kl(mu, mu_ref, std, h, form="exact")
    p = torch.distributions.Normal(mu, std[:, None].expand_as(mu))
    q = torch.distributions.Normal(mu_ref, std[:, None].expand_as(mu))
    torch.testing.assert_close(kl, torch.distributions.kl_divergence(p, q).mean(1), **FP32_REORDER)
    # Flow-GRPO's form divides by g^2 = std^2 / h instead of std^2
    torch.testing.assert_close(gaussian_step_kl(mu, mu_ref, std, h, form="flow_grpo"), kl * h, **FP32_REORDER)
    assert torch.all(gaussian_step_kl(mu, mu, std, h) == 0)  # exact: mu - mu = 0
    with pytest.raises(ValueError, match="kl form"):
        gaussian_step_kl(mu, mu_ref, std, h, form="reverse")

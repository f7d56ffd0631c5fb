"""The corrector core (difrl.correct): hand-computed values and the properties every method must keep.

    pytest tests/test_correct.py -q
"""

import math
import subprocess
import sys

import pytest
import torch

from difrl.correct import (
    METHODS,
    POLICY_LOSSES,
    ais,
    aspo_loss,
    ctpo_log_ratio,
    ctpo_loss,
    ess_fraction,
    geo_rs,
    gspo_log_ratio,
    gspo_loss,
    k2_rs,
    k3_rs,
    minpro,
    option_problems,
    seq_mis,
    seq_tis,
    seq_tis_bn,
    token_mis,
    token_tis,
    token_tis_bn,
    vcpo_lr_scale,
    vespo,
    vespo_loss,
)

# rho = pi / mu per token; row 1's last position is padding (its value must never matter)
RHO = torch.tensor([[2.0, 0.5, 1.0], [4.0, 1.0, 0.25]])
MASK = torch.tensor([[True, True, True], [True, True, False]])
LP_MU = torch.zeros(2, 3)
LP = torch.log(RHO)


def close(a, b):  # fp32 weights (exp / log of O(1) values) against float64 hand values: FP32_VS_FP64's reason
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), rtol=1e-5, atol=1e-6)


def test_token_tis_caps():
    c = token_tis(LP, LP_MU, MASK, cap=2.0)
    close(c.weights, [[2.0, 0.5, 1.0], [2.0, 1.0, 0.0]])
    assert c.keep.tolist() == MASK.tolist() and float(c.weights.max()) <= 2.0
    close(c.diagnostics["max_weight"], 2.0)
    close(c.diagnostics["masked_frac"], 0.0)


def test_token_mis_masks_exactly_outside_the_band():
    c = token_mis(LP, LP_MU, MASK, low=0.5, high=2.0)
    assert c.keep.tolist() == [[True, True, True], [False, True, False]]
    close(c.weights, [[2.0, 0.5, 1.0], [0.0, 1.0, 0.0]])
    close(c.diagnostics["masked_frac"], 1 / 5)


def test_sequence_tis_and_mis():
    c = seq_tis(LP, LP_MU, MASK, cap=5.0)
    close(c.weights, [[1.0, 1.0, 1.0], [4.0, 4.0, 0.0]])  # products over valid positions: 1 and 4
    assert float(seq_tis(LP, LP_MU, MASK, cap=3.0).weights.max()) == 3.0
    m = seq_mis(LP, LP_MU, MASK, low=0.5, high=2.0)
    assert m.keep.tolist() == [[True, True, True], [False, False, False]]
    close(m.weights, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])


def test_geometric_k2_k3_rejection():
    assert geo_rs(LP, LP_MU, MASK).keep.tolist() == [[True] * 3, [False] * 3]  # geo means 1 and 2
    assert geo_rs(LP, LP_MU, MASK, low=0.4, high=2.5).keep.tolist() == MASK.tolist()
    # K2 = (log rho)^2 / 2: log 2 -> 0.240, log 4 -> 0.961
    assert k2_rs(LP, LP_MU, MASK, threshold=0.5).keep.tolist() == [[True, True, True], [False, True, False]]
    assert k2_rs(LP, LP_MU, MASK, threshold=0.5, aggregate="max").keep.tolist() == [[True] * 3, [False] * 3]
    # seq means: (0.240 + 0.240 + 0) / 3 = 0.160 and 0.961 / 2 = 0.480
    assert k2_rs(LP, LP_MU, MASK, threshold=0.3, aggregate="mean").keep.tolist() == [[True] * 3, [False] * 3]
    assert k2_rs(LP, LP_MU, MASK, threshold=0.5, aggregate="mean").keep.tolist() == MASK.tolist()
    # K3 means: (0.3069 + 0.1931 + 0) / 3 = 0.1667 and (4 - log 4 - 1) / 2 = 0.8069
    assert k3_rs(LP, LP_MU, MASK, threshold=0.5).keep.tolist() == [[True] * 3, [False] * 3]
    assert k3_rs(LP, LP_MU, MASK, threshold=0.81).keep.tolist() == MASK.tolist()
    c = k3_rs(LP, LP_MU, MASK, threshold=1.0)
    expected_k3 = ((2 - math.log(2) - 1) + (0.5 + math.log(2) - 1) + (4 - math.log(4) - 1)) / 5
    close(c.diagnostics["kl_k3"], expected_k3)
    close(c.diagnostics["kl_k1"], -(math.log(2) + math.log(0.5) + math.log(4)) / 5)
    close(c.diagnostics["chi2"], (4 + 0.25 + 1 + 16 + 1) / 5 - 1)


def test_minpro_prefix_minimum():
    c = minpro(LP, LP_MU, MASK, cap=2.0)
    # row 0: rho (2, .5, 1): w = (min(2,C), 1 * .5, min(2,.5) * 1); row 1: (min(4,C), 1 * 1, pad)
    close(c.weights, [[2.0, 0.5, 0.5], [2.0, 1.0, 0.0]])


def test_vespo_kernel():
    adv = torch.tensor([1.0, 1.0])
    c = vespo(LP, LP_MU, adv, MASK)
    log_phi = 3 + 2 * math.log(4) - 3 * 4  # (k, lam) = (2, 3) for A >= 0, W = 4
    close(c.weights, [[1.0, 1.0, 1.0], [math.exp(log_phi), math.exp(log_phi), 0.0]])
    neg = vespo(LP, LP_MU, -adv, MASK)
    close(neg.weights[1, 0], math.exp(2 + 3 * math.log(4) - 2 * 4))  # (3, 2) for A < 0
    # the kernel peaks at W = k / lam
    ws = torch.linspace(0.1, 3, 300)
    lp = torch.log(ws)[:, None]
    phi = vespo(lp, torch.zeros_like(lp), torch.ones(300), None).weights[:, 0]
    assert abs(float(ws[phi.argmax()]) - 2 / 3) < 0.02  # two steps of the 300-point grid (0.0097 apart)


def test_gspo_value_is_the_geometric_mean_and_gradient_is_per_token():
    lp = LP.clone().requires_grad_(True)
    s = gspo_log_ratio(lp, LP_MU, MASK)
    close(s.detach(), [[0.0, 0.0, 0.0], [math.log(2), math.log(2), 0.0]])  # exp(mean log r): 1 and 2
    s.sum().backward()
    close(lp.grad, MASK.float())


def test_ctpo_cumulative_ratio_and_bounds():
    lp = LP.clone().requires_grad_(True)
    log_r, lo, hi = ctpo_log_ratio(lp, LP_MU, MASK)
    close(log_r.detach(), [[math.log(2), 0.0, 0.0], [math.log(4), math.log(4), 0.0]])  # prefix products
    t = torch.arange(1, 4.0)
    close(lo, (-0.025 * t.sqrt())[None])
    close(hi, (0.05 * t.sqrt())[None])
    log_r.sum().backward()
    close(lp.grad, MASK.float())  # the gradient goes through token t only


def test_aspo_flips_the_weight_for_positive_advantages():
    lp_old = torch.zeros(1, 2)
    lp = torch.log(torch.tensor([[0.5, 0.2]])).requires_grad_(True)
    loss = aspo_loss(lp, lp_old, torch.tensor([1.0]), dual_clip=3.0)
    loss.sum().backward()
    # r = 0.5: gradient -A / r = -2; r = 0.2: 1/r = 5 > c, soft dual-clip -A c log pi -> gradient -3
    close(lp.grad, [[-2.0, -3.0]])
    lpn = torch.log(torch.tensor([[0.5, 4.0]])).requires_grad_(True)
    aspo_loss(lpn, lp_old, torch.tensor([-1.0]), eps_low=0.2).sum().backward()
    # A < 0: r = 0.5 below 1 - eps -> clamped, no gradient; r = 4 > c -> -A c log pi -> gradient 3
    close(lpn.grad, [[0.0, 3.0]])


def test_ess_and_vcpo_scale():
    m = torch.ones(1, 2, dtype=torch.bool)
    close(ess_fraction(torch.tensor([[1.0, 1.0]]), m), 1.0)
    close(ess_fraction(torch.tensor([[1.0, 3.0]]), m), 16 / 20)
    close(vcpo_lr_scale(torch.tensor([[1.0, 3.0]]), m), math.sqrt(0.8))
    # padding does not count
    close(ess_fraction(torch.tensor([[1.0, 1.0, 50.0]]), torch.tensor([[True, True, False]])), 1.0)


def test_ais_limits():
    torch.manual_seed(0)
    lp_mu = torch.randn(8, 10)
    same = ais(lp_mu.clone(), lp_mu, None)
    assert float(same.diagnostics["ais_lambda"]) == 0.0 and torch.all(same.weights == 1)
    small = ais(lp_mu + 1e-4 * torch.randn(8, 10), lp_mu, None)
    assert float(small.diagnostics["ais_lambda"]) < 0.01  # a tiny mismatch stays (almost) uncorrected
    far = lp_mu + 3.0 * torch.randn(8, 10)  # extreme: rho spans e^-9 ... e^9
    c = ais(far, lp_mu, None, cap=2.0)
    assert float(c.diagnostics["ais_lambda"]) > 0.999  # fully weighted ...
    rho = torch.exp(far - lp_mu)
    assert torch.equal(c.keep, (rho >= 0.5) & (rho <= 2.0))  # ... and the toxic tails masked (raw ESS/n < 0.5)
    # lambda > 0.999: the weights are lambda rho + (1 - lambda), within (1 - lambda) |rho - 1| <= 1e-3 of rho
    torch.testing.assert_close(c.weights[c.keep], rho[c.keep].clamp(max=2.0), rtol=1e-3, atol=1e-3)
    # in between, the weights interpolate between 1 and the TIS weights
    mid = ais(lp_mu + 0.05 * torch.randn(8, 10), lp_mu, None, kl_scale=1e-3)
    lam = float(mid.diagnostics["ais_lambda"])
    assert 0.2 < lam < 1.0 and mid.keep.all()  # reliable weights: mixed, nothing masked


def test_k3_keeps_its_value_for_tiny_mismatches():
    """K3 ~ (log rho)^2 / 2: at log rho = 1e-5 that is 5e-11, which exp(lr) - lr - 1 in fp32 rounds to exactly 0."""
    lp_mu = torch.zeros(2, 4)
    lp = lp_mu + torch.tensor([[1e-5, -1e-5, 2e-5, 0.0], [3e-4, 1e-6, -1e-6, 1e-5]])
    expect = (lp - lp_mu).double() ** 2 / 2
    c = token_tis(lp, lp_mu)
    # K3 = (log rho)^2 / 2 + O(|log rho|^3): relative error |log rho| / 3 <= 1e-4 for these; 1e-3 leaves fp32 room
    assert c.diagnostics["kl_k3"].item() == pytest.approx(float(expect.mean()), rel=1e-3)
    lam = ais(lp, lp_mu, kl_scale=1e-9).diagnostics["ais_lambda"].item()
    assert lam == pytest.approx(1 - math.exp(-float(expect.mean()) / 1e-9), rel=1e-3)
    assert k3_rs(lp, lp_mu, threshold=float(expect[0].max()) * 0.99, aggregate="token").keep[0].tolist() == [True, True, False, True]


def test_batch_normalised_tis_divides_by_the_batch_mean():
    # token level: min(rho, 2) = [[2, .5, 1], [2, 1, -]], mean over the 5 valid tokens 6.5 / 5 = 1.3
    c = token_tis_bn(LP, LP_MU, MASK, cap=2.0)
    close(c.weights, [[2 / 1.3, 0.5 / 1.3, 1 / 1.3], [2 / 1.3, 1 / 1.3, 0.0]])
    close(c.diagnostics["batch_mean_weight"], 1.3)
    close((c.weights * MASK).sum() / MASK.sum(), 1.0)
    # sequence level: products 1 and 4 (cap 5), mean over the 2 sequences 2.5
    s = seq_tis_bn(LP, LP_MU, MASK)
    close(s.weights, [[0.4, 0.4, 0.4], [1.6, 1.6, 0.0]])
    # a capped sequence: min(4, 3) = 3, mean (1 + 3) / 2 = 2
    close(seq_tis_bn(LP, LP_MU, MASK, cap=3.0).weights, [[0.5, 0.5, 0.5], [1.5, 1.5, 0.0]])


def test_k3_rejection_per_token_sum_and_max():
    # K3_t = rho - log rho - 1: rho 2 -> 0.3069, 0.5 -> 0.1931, 1 -> 0, 4 -> 1.6137
    assert k3_rs(LP, LP_MU, MASK, 0.25, "token").keep.tolist() == [[False, True, True], [False, True, False]]
    assert k3_rs(LP, LP_MU, MASK, 1.0, "sum").keep.tolist() == [[True] * 3, [False] * 3]  # sums 0.5, 1.614
    assert k3_rs(LP, LP_MU, MASK, 0.31, "max").keep.tolist() == [[True] * 3, [False] * 3]  # maxima 0.307, 1.614
    assert not k3_rs(LP, LP_MU, MASK, 0.30, "max").keep.any()
    assert k3_rs(LP, LP_MU, MASK, 0.5, "mean").keep.tolist() == [[True] * 3, [False] * 3]  # means 0.167, 0.807
    assert k3_rs(LP, LP_MU, MASK, 0.17, "mean").keep.tolist() == k3_rs(LP, LP_MU, MASK, 0.17).keep.tolist()
    with pytest.raises(ValueError, match="aggregate must be"):
        k3_rs(LP, LP_MU, MASK, 0.1, "median")


def test_gspo_loss_clips_the_sequence_ratio():
    lp = LP.clone().requires_grad_(True)
    # s = exp(mean log r): row 0: 2 * .5 * 1 -> 1; row 1: 4 * 1 over 2 tokens -> 2, clipped to 1 + 4e-4
    loss = gspo_loss(lp, LP_MU, torch.tensor([1.0, 1.0]), MASK)
    close(loss, [[-1.0, -1.0, -1.0], [-1.0004, -1.0004, 0.0]])
    loss.sum().backward()
    close(lp.grad, [[-1.0, -1.0, -1.0], [0.0, 0.0, 0.0]])  # the clipped sequence gives no gradient


def test_ctpo_loss_clips_the_prefix_ratio_by_position_and_dual_clips_negative_advantages():
    loss = ctpo_loss(LP, LP_MU, torch.tensor([1.0, -1.0]), MASK)
    e = math.exp
    # A > 0, row 0: log R = [log 2, 0, 0]; at t = 1 the bound is 0.05: max(-2, -e^0.05)
    close(loss[0], [-e(0.05), -1.0, -1.0])
    # A < 0, row 1: R = 4 at t = 1, 2: max(4, e^(0.05 sqrt t)) = 4, dual clip min(4, e^(0.05 t^0.5))
    close(loss[1], [e(0.05), e(0.05 * math.sqrt(2)), 0.0])


def test_vespo_loss_is_the_kernel_times_the_reinforce_term():
    lp = LP.clone().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0])
    phi = vespo(LP, LP_MU, adv, MASK).weights
    loss = vespo_loss(lp, LP_MU, adv, MASK)
    close(loss, -phi * adv[:, None] * LP * MASK)
    loss.sum().backward()
    close(lp.grad, -phi * adv[:, None])
    # with the rollout's pi_old / mu factor the kernel sees the product of both ratios
    both = vespo_loss(LP, LP_MU, adv, MASK, log_prob_rollout=LP_MU - 0.1)
    close(both, -vespo(LP, LP_MU, adv, MASK, log_prob_rollout=LP_MU - 0.1).weights * adv[:, None] * LP * MASK)


def test_policy_losses_vanish_on_padding_and_options_are_checked():
    for name, fn in POLICY_LOSSES.items():
        assert fn(LP, LP_MU, torch.tensor([1.0, -1.0]), MASK)[1, 2] == 0.0, name
    assert option_problems("k3_rs", k3_rs, {"threshold": 0.1, "aggregate": "max"}, ("log_prob", "log_prob_rollout", "mask")) == []
    problems = option_problems("token_mis", token_mis, {"low": 3.0, "high": 2.0}, ("log_prob", "log_prob_rollout", "mask"))
    assert problems == [("low", "= 3.0 is above high = 2.0")]
    assert option_problems("ctpo", ctpo_loss, {"power": -0.5, "c_low": float("nan")}, ("log_prob",))[0][0] == "c_low"


# ---- properties every method keeps ------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(METHODS))
def test_equal_log_probs_are_the_identity(name):
    lp = torch.randn(4, 6)
    mask = torch.rand(4, 6) > 0.2
    c = METHODS[name](lp, lp.clone(), mask)
    assert c.keep.tolist() == mask.tolist()
    assert torch.equal(c.weights, mask.float())  # exact: rho = exp(0) = 1 on the mask, 0 off it
    close(c.diagnostics["ess_frac"], 1.0)
    close(c.diagnostics["kl_k3"], 0.0)


@pytest.mark.parametrize("name", sorted(METHODS))
def test_padding_never_changes_a_result(name):
    torch.manual_seed(1)
    lp_mu = torch.randn(4, 6)
    lp = lp_mu + 0.3 * torch.randn(4, 6)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[:, 4:] = False
    a = METHODS[name](lp, lp_mu, mask)
    lp2, lp_mu2 = lp.clone(), lp_mu.clone()
    lp2[:, 4:] = 1e6  # garbage where the mask is off
    lp_mu2[:, 4:] = -1e6
    b = METHODS[name](lp2, lp_mu2, mask)
    assert torch.equal(a.weights, b.weights) and torch.equal(a.keep, b.keep)
    for k in a.diagnostics:  # masked means over the same values: fp32, at most reordered
        torch.testing.assert_close(a.diagnostics[k], b.diagnostics[k], rtol=1e-5, atol=1e-6)
    # and a batch padded to a longer T gives the same weights on the real positions
    c = METHODS[name](torch.cat([lp[:, :4], torch.zeros(4, 3)], 1), torch.cat([lp_mu[:, :4], torch.zeros(4, 3)], 1),
                      torch.cat([mask[:, :4], torch.zeros(4, 3, dtype=torch.bool)], 1))
    torch.testing.assert_close(c.weights[:, :4], a.weights[:, :4], rtol=1e-5, atol=1e-6)  # rows of 7 vs 6: reordered


@pytest.mark.parametrize("name", sorted(METHODS))
def test_weights_are_detached(name):
    lp = torch.randn(3, 5, requires_grad=True)
    c = METHODS[name](lp, torch.randn(3, 5), None)
    assert not c.weights.requires_grad
    (c.weights * lp).sum().backward()  # the gradient flows through log_prob only, scaled by the weights
    torch.testing.assert_close(lp.grad, c.weights, rtol=0, atol=0)  # exact: d(w lp)/d lp is w x 1


def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        token_tis(torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match="mask must be"):
        token_tis(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(3, 2, dtype=torch.bool))


def test_huge_log_ratios_stay_finite():
    c = seq_tis(torch.full((2, 50), 10.0), torch.zeros(2, 50), None, cap=1e30)
    assert torch.isfinite(c.weights).all() and torch.isfinite(c.diagnostics["chi2"])


def test_import_pulls_in_nothing_else():
    code = ("import sys, difrl.correct; bad = [m for m in sys.modules if m.split('.')[0] in "
            "('diffusers', 'transformers', 'accelerate', 'peft') or (m.startswith('difrl.') and "
            "not m.startswith('difrl.correct'))]; print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_llm_example_trains_a_tiny_causal_lm_with_the_same_core():
    import ast
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "llm_correct_example.py"
    imported = {n.module for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom)}
    assert {m for m in imported if m.startswith("difrl")} <= {"difrl.correct", "difrl.quant"}
    spec = importlib.util.spec_from_file_location("llm_correct_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    results = mod.main(["--iterations", "3", "--methods", "none", "ais", "--groups", "2", "--group-size", "4"])
    assert [r["method"] for r in results] == ["none", "ais"]
    for r in results:
        mean = sum(h["reward"] for h in r["history"]) / 3  # float64, maybe summed in another order
        assert len(r["history"]) == 3 and r["final_reward"] == pytest.approx(mean, rel=1e-12)
        assert all(h["mean_log_ratio"] != 0.0 and h["kl_k3"] > 0.0 for h in r["history"])  # NVFP4 copy != trainer
    assert all(0.0 < h["ais_lambda"] < 1.0 for h in results[1]["history"])  # a mismatch, so AIS mixes in some IS

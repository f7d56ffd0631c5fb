"""Step kernels, schedules and step masks: the math of docs/reference/specs/flow-grpo-family.md §1-2 and
docs/reference/specs/branch-cps-guard.md §2.

    pytest tests/test_kernels.py -q
"""

import math

import pytest
import torch

from difrl.samplers import (
    KERNELS,
    all_but_last,
    cps_step,
    dance_sde_step,
    fixed_window,
    flow_sde_step,
    gaussian_log_prob,
    ode_step,
    random_subset,
    random_window,
    sigma_schedule,
    sliding_window_start,
    split_step,
    time_shift,
)

SDE_KERNELS = ["flow_sde", "dance_sde", "cps"]
# Exact float comparisons here: the same kernel's ops on the same values (a re-call, a unit scale, a row of a batch:
# elementwise IEEE ops and per-row reductions of the same few elements), or values the kernel sets (std 0 and
# log-prob 0 of an ODE step, a schedule's end points). Moments of sampled marginals are checked within a few standard
# errors of n seeded draws (stated per test). The rest: fp32 against another op order or float64, stated inline.
from tolerances import FP32_REORDER, FP32_VS_FP64  # noqa: E402


def _xv(shape=(6, 3, 4, 4), seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g), torch.randn(shape, generator=g)


# ---- noise level 0 == Euler ODE --------------------------------------------------------------------

@pytest.mark.parametrize("name", SDE_KERNELS)
@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.9), (0.7, 0.55), (0.2, 0.1), (0.1, 0.0)])
def test_noise_level_zero_is_the_euler_ode_step(name, sigma, sigma_next):
    x, v, noise = _xv()
    out = KERNELS[name](x, v, sigma, sigma_next, noise, noise_level=0.0)
    euler = x + (sigma_next - sigma) * v
    torch.testing.assert_close(out.x_next, euler, rtol=0, atol=1e-6)  # Euler written out in another op order:
    torch.testing.assert_close(out.mean, euler, rtol=0, atol=1e-6)  # fp32, a few ulp of O(1) latents
    assert torch.all(out.std == 0) and torch.all(out.log_prob == 0)


def test_ode_step_is_euler_and_ignores_noise():
    x, v, noise = _xv()
    a = ode_step(x, v, 0.6, 0.4, noise)
    b = ode_step(x, v, 0.6, 0.4)
    torch.testing.assert_close(a.x_next, x - 0.2 * v, rtol=0, atol=1e-6)  # fp32: 0.4 - 0.6 is not exactly -0.2
    assert torch.equal(a.x_next, b.x_next) and torch.all(a.log_prob == 0)


def test_ode_step_matches_diffusers_flow_match_euler_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    N, shift = 8, 3.0
    sched = FlowMatchEulerDiscreteScheduler(shift=shift)
    base = torch.linspace(1.0, 1.0 / N, N)  # what the SD3 / FLUX pipelines pass as `sigmas`
    sched.set_timesteps(sigmas=base.numpy())
    sigmas = sigma_schedule(N, shift)
    torch.testing.assert_close(sched.sigmas.float(), sigmas, rtol=0, atol=1e-6)  # diffusers' numpy float64 vs fp32
    x, v, _ = _xv((2, 4, 8, 8))
    x_ours, x_ref = x.clone(), x.clone()
    for i, t in enumerate(sched.timesteps):
        x_ref = sched.step(v, t, x_ref).prev_sample
        x_ours = ode_step(x_ours, v, sigmas[i], sigmas[i + 1]).x_next
    torch.testing.assert_close(x_ours, x_ref.float(), rtol=0, atol=1e-5)  # N fp32 steps vs the scheduler's: ~N ulp


# ---- CPS keeps the noise variance -------------------------------------------------------------------

@pytest.mark.parametrize("a", [0.3, 0.8, 1.0])
def test_cps_total_noise_variance_is_sigma_next_squared(a):
    """With the exact velocity, x_next = (1 - sigma_next) x0 + c eps + std xi: c^2 + std^2 = sigma_next^2."""
    torch.manual_seed(0)
    n = 200_000
    x0 = torch.full((n, 1), 0.5)
    eps, xi = torch.randn(n, 1), torch.randn(n, 1)
    for sigma, sigma_next in [(1.0, 0.9), (0.6, 0.45), (0.3, 0.2), (0.1, 0.0)]:
        x = (1 - sigma) * x0 + sigma * eps
        v = eps - x0  # oracle velocity
        out = cps_step(x, v, sigma, sigma_next, xi, noise_level=a)
        std = float(out.std[0])
        assert std == pytest.approx(sigma_next * math.sin(a * math.pi / 2), abs=1e-7)  # fp32 std < 1: ~2 ulp
        # coefficient identity (exact): the mean's eps coefficient squared plus std^2
        # (linear in eps: the mean at eps = 1 minus the mean at eps = 0)
        e = torch.tensor([[0.0], [1.0]])
        xe, ve = (1 - sigma) * 0.5 + sigma * e, e - 0.5
        me = cps_step(xe, ve, sigma, sigma_next, torch.zeros(2, 1), noise_level=a).mean
        c = float(me[1] - me[0])
        assert c**2 + std**2 == pytest.approx(sigma_next**2, abs=1e-6)  # fp32 coefficients, squared: ~10 ulp of 1
        # and the sampled noise part has variance sigma_next^2 (empirical, 200k samples)
        noise_part = out.x_next - (1 - sigma_next) * x0
        # empirical: the variance of n = 200k normals has relative std sqrt(2 / n) = 0.3%, so 2% is ~6 std errors
        assert float(noise_part.var()) == pytest.approx(sigma_next**2, rel=0.02, abs=1e-9)


def test_cps_last_step_is_deterministic():
    x, v, noise = _xv()
    out = cps_step(x, v, 0.1, 0.0, noise, noise_level=0.8)
    assert torch.all(out.std == 0)
    torch.testing.assert_close(out.x_next, x - 0.1 * v, rtol=0, atol=1e-6)  # x0_hat; fp32, another op order


# ---- sampled steps are N(mean, std^2) and log_prob is its density -----------------------------------

@pytest.mark.parametrize("name", SDE_KERNELS)
def test_empirical_mean_and_variance_match(name):
    torch.manual_seed(1)
    x, v, _ = _xv((1, 16))
    n = 100_000
    xs, vs = x.expand(n, 16), v.expand(n, 16)
    out = KERNELS[name](xs, vs, 0.6, 0.5, torch.randn(n, 16))
    std = float(out.std[0])
    assert std > 0
    emp_mean, emp_var = out.x_next.mean(0), out.x_next.var(0)
    torch.testing.assert_close(emp_mean, out.mean[0], rtol=0, atol=4 * std / math.sqrt(n) * 2)
    # the mean within 8 standard errors, the variance within 3% (its relative std error sqrt(2 / n) = 0.45%: ~7)
    torch.testing.assert_close(emp_var, torch.full_like(emp_var, std**2), rtol=0.03, atol=0)


@pytest.mark.parametrize("name", SDE_KERNELS)
@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_log_prob_is_the_gaussian_density(name, reduce):
    x, v, noise = _xv()
    out = KERNELS[name](x, v, 0.8, 0.7, noise, reduce=reduce)
    dist = torch.distributions.Normal(out.mean, out.std.view(-1, 1, 1, 1).expand_as(out.mean))
    elem = dist.log_prob(out.x_next).flatten(1)
    expected = elem.mean(1) if reduce == "mean" else elem.sum(1)
    torch.testing.assert_close(out.log_prob, expected, rtol=1e-5, atol=1e-5)  # torch.distributions' op order, fp32


@pytest.mark.parametrize("name", SDE_KERNELS)
def test_scoring_a_stored_action_reproduces_the_sampled_log_prob(name):
    x, v, noise = _xv()
    sampled = KERNELS[name](x, v, 0.8, 0.7, noise)
    scored = KERNELS[name](x, v, 0.8, 0.7, action=sampled.x_next)
    # exact: sampling scores its own x_next with the same ops the stored action goes through
    assert torch.equal(scored.log_prob, sampled.log_prob) and torch.equal(scored.mean, sampled.mean)
    with pytest.raises(ValueError, match="exactly one"):
        KERNELS[name](x, v, 0.8, 0.7, noise, action=sampled.x_next)


def test_log_prob_mean_reduction_handles_packed_and_image_latents():
    x, v, noise = _xv((3, 16, 8))  # packed [B, L, C] as FLUX
    out = flow_sde_step(x, v, 0.5, 0.4, noise)
    assert out.log_prob.shape == (3,) and out.std.shape == (3,)
    total = flow_sde_step(x, v, 0.5, 0.4, noise, reduce="sum").log_prob
    torch.testing.assert_close(total, out.log_prob * 16 * 8, rtol=1e-5, atol=1e-4)  # a sum vs 128 x a mean, fp32


def test_cps_flow_grpo_log_prob_form_is_the_unnormalised_square():
    x, v, noise = _xv()
    out = cps_step(x, v, 0.8, 0.7, noise, log_prob_form="flow_grpo")
    torch.testing.assert_close(out.log_prob, -((out.x_next - out.mean) ** 2).flatten(1).mean(1), **FP32_REORDER)


@pytest.mark.parametrize("name", ["ode"] + SDE_KERNELS)
def test_per_row_sigmas_equal_scalar_calls(name):
    """[B] sigmas let one call evaluate transitions of different steps (the trainer batches them)."""
    x, v, noise = _xv((4, 8))
    sig = torch.tensor([1.0, 0.8, 0.5, 0.2])
    sig_next = torch.tensor([0.9, 0.7, 0.4, 0.1])
    batched = KERNELS[name](x, v, sig, sig_next, noise)
    for b in range(4):
        row = KERNELS[name](x[b:b + 1], v[b:b + 1], float(sig[b]), float(sig_next[b]), noise[b:b + 1])
        for got, want in zip(batched, row):
            # exact: per row the same elementwise ops on the same fp32 values (a Python float sigma is the row's
            # fp32 value) and the same 8-element reductions
            torch.testing.assert_close(got[b:b + 1], want, rtol=0, atol=0)


def test_flow_sde_guard_at_sigma_one_is_finite():
    x, v, noise = _xv()
    out = flow_sde_step(x, v, 1.0, 0.9, noise, noise_level=0.7)
    g = 0.7 * math.sqrt(1.0 / (1.0 - 0.9))  # sigma~ = sigma_next at sigma == 1
    assert float(out.std[0]) == pytest.approx(g * math.sqrt(0.1), rel=1e-6)
    assert torch.isfinite(out.x_next).all() and torch.isfinite(out.log_prob).all()


def test_dance_sde_std_is_constant_eta_times_sqrt_h():
    x, v, noise = _xv()
    for sigma, sigma_next in [(1.0, 0.9), (0.3, 0.1)]:
        out = dance_sde_step(x, v, sigma, sigma_next, noise, noise_level=0.3)
        assert float(out.std[0]) == pytest.approx(0.3 * math.sqrt(sigma - sigma_next), rel=1e-6)


def test_kernels_compute_in_fp32_from_bf16_inputs():
    x, v, noise = _xv()
    out = flow_sde_step(x.bfloat16(), v.bfloat16(), 0.5, 0.4, noise)
    assert out.x_next.dtype == out.log_prob.dtype == out.mean.dtype == torch.float32


def test_gaussian_log_prob_zero_where_std_zero():
    mean = torch.zeros(2, 3)
    lp = gaussian_log_prob(torch.ones(2, 3), mean, torch.tensor([0.0, 1.0]))
    assert lp[0] == 0 and lp[1] == FP32_VS_FP64.approx(-0.5 - 0.5 * math.log(2 * math.pi))  # std 0: set to 0


# ---- split_step: a kernel with its std scaled by kappa (BranchGRPO's split steps) -------------------

def test_split_step_with_unit_scales_is_the_kernel():
    g = torch.Generator().manual_seed(0)
    x, v, z = (torch.randn(4, 16, generator=g) for _ in range(3))
    for kind in ("flow_sde", "dance_sde", "cps"):
        ref = KERNELS[kind](x, v, 0.8, 0.6, z)
        for scale in (1.0, torch.ones(4)):
            out = split_step(kind, x, v, 0.8, 0.6, z, noise_scale=scale)
            for a, b in zip(out, ref):
                assert torch.equal(a, b), kind
        # a per-row scale: row 0 is kappa = 2 (its std doubles), the rest equal the kernel
        mixed = split_step(kind, x, v, 0.8, 0.6, action=ref.x_next, logprob_scale=torch.tensor([2.0, 1, 1, 1]))
        assert torch.equal(mixed.log_prob[1:], ref.log_prob[1:]) and torch.equal(mixed.std[0], 2 * ref.std[0])


# ---- 1-D Gaussian toy: the SDE samplers' marginals match the ODE's ---------------------------------

def _toy_velocity(m: float, s: float):
    """Exact v(x, sigma) = E[eps - x0 | x_sigma] for x0 ~ N(m, s^2), x_sigma = (1 - sigma) x0 + sigma eps."""

    def v(x, sigma):
        var = (1 - sigma) ** 2 * s**2 + sigma**2
        r = x - (1 - sigma) * m
        e_x0 = m + (1 - sigma) * s**2 / var * r
        e_eps = sigma / var * r
        return e_eps - e_x0

    return v


@pytest.mark.parametrize("name,level", [("ode", 0.0), ("flow_sde", 0.7), ("flow_sde", 1.0), ("dance_sde", 0.5)])
def test_gaussian_toy_marginals_match(name, level):
    """Every kernel transports N(0, 1) at sigma = 1 to the data law N(m, s^2); the SDEs add noise and
    (in the Flow-GRPO / DanceGRPO drift, or CPS's coefficients) take exactly as much back."""
    m, s, N, n = 1.5, 0.5, 100, 200_000
    vel = _toy_velocity(m, s)
    sigmas = sigma_schedule(N).double()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(n, 1, generator=gen)
    mid = N // 2
    for i in range(N):
        sigma, sigma_next = float(sigmas[i]), float(sigmas[i + 1])
        kw = {} if name == "ode" else {"noise_level": level}
        x = KERNELS[name](x, vel(x, sigma), sigma, sigma_next, torch.randn(n, 1, generator=gen), **kw).x_next
        if i + 1 == mid:  # intermediate marginal: N((1 - sigma) m, (1 - sigma)^2 s^2 + sigma^2)
            sm = sigma_next
            # n = 200k draws: the mean's standard error is ~0.5 / 450 = 1e-3; 0.02 and 3% also absorb the 100-step
            # discretization of the transport
            assert float(x.mean()) == pytest.approx((1 - sm) * m, abs=0.02)
            assert float(x.std()) == pytest.approx(math.sqrt((1 - sm) ** 2 * s**2 + sm**2), rel=0.03)
    assert float(x.mean()) == pytest.approx(m, abs=0.02)
    assert float(x.std()) == pytest.approx(s, rel=0.04)


def test_cps_on_the_toy_keeps_the_mean_and_under_disperses():
    """CPS preserves the noise *coefficient* (test above), which is the marginal only when x0_hat is the
    true x0. With the exact posterior-mean velocity, every step replaces sin(a pi / 2) of the noise and
    drops Var(x0 | x): the final std is low by a bias that does not shrink with more steps
    (measured: a = 0.8 gives 0.40 at 100 and 400 steps for a target of 0.5; a = 0.3 gives 0.48).
    This pins that behaviour so a change to the kernel that alters it is noticed."""
    m, s, N, n = 1.5, 0.5, 100, 100_000
    vel = _toy_velocity(m, s)
    sigmas = sigma_schedule(N).double()
    gen = torch.Generator().manual_seed(3)
    finals = {}
    for a in (0.3, 0.8):
        x = torch.randn(n, 1, generator=gen)
        for i in range(N):
            sigma, sigma_next = float(sigmas[i]), float(sigmas[i + 1])
            x = cps_step(x, vel(x, sigma), sigma, sigma_next, torch.randn(n, 1, generator=gen), noise_level=a).x_next
        assert float(x.mean()) == pytest.approx(m, abs=0.02)  # as in test_gaussian_toy_marginals_match
        finals[a] = float(x.std())
    assert finals[0.3] == pytest.approx(s, rel=0.06)  # the measured bias (0.48 for 0.5, docstring) plus noise
    assert 0.35 < finals[0.8] < 0.45


# ---- schedules ---------------------------------------------------------------------------------------

def test_sigma_schedule_endpoints_and_shift():
    s = sigma_schedule(10)
    torch.testing.assert_close(s, torch.linspace(1, 0, 11), **FP32_REORDER)  # fp32 grids in another op order
    shifted = sigma_schedule(10, shift=3.0)
    assert shifted[0] == 1.0 and shifted[-1] == 0.0
    t = torch.linspace(1, 0, 11)
    torch.testing.assert_close(shifted, 3 * t / (1 + 2 * t), **FP32_REORDER)
    assert torch.all(shifted >= s) and torch.all(shifted[1:] < shifted[:-1])
    torch.testing.assert_close(time_shift(torch.tensor(0.5), 1.0), torch.tensor(0.5), **FP32_REORDER)
    with pytest.raises(ValueError):
        sigma_schedule(0)


# ---- step masks --------------------------------------------------------------------------------------

def test_all_but_last_and_fixed_window():
    assert all_but_last(5).tolist() == [True, True, True, True, False]
    assert all_but_last(1).tolist() == [True]
    assert fixed_window(6, 1, 2).tolist() == [False, True, True, False, False, False]
    with pytest.raises(ValueError, match="does not fit"):
        fixed_window(6, 5, 2)


def test_random_window_stays_in_range_and_is_reproducible():
    starts = set()
    for it in range(200):
        mask = random_window(10, 2, 1, 7, torch.Generator().manual_seed(it))
        idx = mask.nonzero().flatten().tolist()
        assert len(idx) == 2 and idx[1] == idx[0] + 1 and idx[0] >= 1 and idx[1] < 7
        starts.add(idx[0])
        assert torch.equal(mask, random_window(10, 2, 1, 7, torch.Generator().manual_seed(it)))
    assert starts == {1, 2, 3, 4, 5}  # every allowed start is reached
    with pytest.raises(ValueError):
        random_window(10, 4, 8, 10, torch.Generator())


def test_sliding_window_advances_and_rolls_back():
    # 10 steps, window 3: starts 0..6 (the last step is never trained), advancing every 2 iterations
    starts = [sliding_window_start(it, 3, 10, advance_every=2) for it in range(16)]
    assert starts == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 0, 0]
    assert sliding_window_start(100, 3, 10, advance_every=2, roll_back=False) == 6
    with pytest.raises(ValueError):
        sliding_window_start(0, 10, 10, advance_every=1)


def test_random_subset_per_sample():
    mask = random_subset(64, 10, 0.6, torch.Generator().manual_seed(0))
    assert mask.shape == (64, 10)
    assert torch.all(mask.sum(1) == 5)  # floor(0.6 * 9)
    assert not mask[:, -1].any()
    assert len({tuple(r) for r in mask.tolist()}) > 10  # independent per sample

"""Rollout engine: seeds in, trajectories out (docs/architecture.md seam 3).

    pytest tests/test_rollout.py -q
"""

import pytest
import torch

from difrl.models.base import cond_repeat
from difrl.models.digits import DigitsFlowNet, DigitsNetConfig, DigitsPolicy, digit_prompt
from difrl.rollout import INIT_STEP, recompute, regenerate, rollout, sample_noise
from difrl.samplers import KERNELS, all_but_last, fixed_window, random_subset, sigma_schedule

# Exact float comparisons here: noise drawn from (seed, step) by a counter-based generator, the same rollout run twice
# on the same rows, stored values that are copies of others; a re-run in another batch shape is fp32-reordered
# (a few ulp of the O(1) latents: 1e-5 after N steps), stated inline.

N = 6


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    net = DigitsFlowNet(DigitsNetConfig(hidden=32, blocks=2, mlp_ratio=2)).eval()
    return DigitsPolicy(net)


def prompts(k=6):
    return [digit_prompt(d % 10) for d in range(k)]


def test_sample_noise_depends_only_on_seed_and_step():
    a = sample_noise(torch.tensor([5, 7, 9]), 2, (4,))
    b = sample_noise(torch.tensor([9, 5]), 2, (4,))
    assert torch.equal(a[0], b[1]) and torch.equal(a[2], b[0])  # batch position and company do not matter
    assert not torch.equal(a[0], sample_noise(torch.tensor([5]), 3, (4,))[0])  # other step, other noise
    assert not torch.equal(a[0], sample_noise(torch.tensor([6]), 2, (4,))[0])
    init = sample_noise(torch.tensor([5]), INIT_STEP, (4,))
    assert not torch.equal(init[0], a[0])


@pytest.mark.parametrize("kernel", ["flow_sde", "dance_sde", "cps"])
def test_regenerate_is_bit_exact(policy, kernel):
    sig = sigma_schedule(N)
    kw = dict(kernel=kernel, sde_mask=all_but_last(N), train_mask=all_but_last(N))
    first = rollout(policy, prompts(), torch.arange(100, 106), sig, **kw)
    again = regenerate(policy, first, sig, **kw)
    for name in ("x_final", "x", "x_next", "log_prob_old", "mean_old", "sigma", "step"):
        assert torch.equal(getattr(first, name), getattr(again, name)), name
    # one sample alone or in other forward batches is the same sample up to float rounding: its noise is
    # identical, but CPU matmuls may block differently by batch size (bit-exact = same forward batches)
    solo = regenerate(policy, first.select(torch.tensor([3])), sig, **kw)
    torch.testing.assert_close(solo.x_final[0], first.x_final[3], rtol=0, atol=1e-5)  # batch of 1 vs of 8
    chunked = regenerate(policy, first, sig, batch_size=4, **kw)
    torch.testing.assert_close(chunked.x_final, first.x_final, rtol=0, atol=1e-5)


def test_stored_transitions_shapes_and_steps(policy):
    sig = sigma_schedule(N)
    window = fixed_window(N, 1, 3)
    batch = rollout(policy, prompts(4), torch.arange(4), sig, kernel="flow_sde", sde_mask=window, train_mask=window,
                    prompt_ids=torch.tensor([0, 0, 1, 1]), group_ids=torch.tensor([0, 0, 1, 1]))
    assert batch.x.shape == batch.x_next.shape == batch.mean_old.shape == (4, 3, 64)
    assert batch.step.tolist() == [[1, 2, 3]] * 4
    torch.testing.assert_close(batch.sigma, sig[1:4].expand(4, 3), rtol=0, atol=0)  # exact: copies of the schedule
    torch.testing.assert_close(batch.sigma_next, sig[2:5].expand(4, 3), rtol=0, atol=0)
    # transitions chain: x_next of one stored step is x of the next one (contiguous window)
    assert torch.equal(batch.x_next[:, :-1], batch.x[:, 1:])
    assert batch.group_ids.tolist() == [0, 0, 1, 1]


def test_per_sample_train_masks(policy):
    sig = sigma_schedule(N)
    tm = random_subset(5, N, 0.4, torch.Generator().manual_seed(0))  # 2 of the first 5 steps per sample
    batch = rollout(policy, prompts(5), torch.arange(5), sig, kernel="dance_sde", train_mask=tm)
    for b in range(5):
        assert batch.step[b].tolist() == tm[b].nonzero().flatten().tolist()


def test_recomputed_log_prob_equals_the_rollouts(policy):
    """What the trainer relies on for ratio == 1: scoring the stored x_next in one batched forward over
    all (sample, step) pairs gives the rollout's log-prob."""
    sig = sigma_schedule(N)
    batch = rollout(policy, prompts(), torch.arange(6), sig, kernel="flow_sde", sde_mask=all_but_last(N),
                    train_mask=all_but_last(N))
    B, T = batch.step.shape
    flat = lambda t: t.reshape(B * T, *t.shape[2:])
    with torch.no_grad():
        v = policy.velocity(flat(batch.x), flat(batch.sigma), cond_repeat(batch.cond, T))
    out = KERNELS["flow_sde"](flat(batch.x), v, flat(batch.sigma), flat(batch.sigma_next), action=flat(batch.x_next))
    # one forward over B*T rows against the sampler's B rows per step: fp32 reordering, a few ulp of O(1) values
    torch.testing.assert_close(out.log_prob.view(B, T), batch.log_prob_old, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.mean.view_as(batch.mean_old), batch.mean_old, rtol=0, atol=1e-6)
    # recompute is that forward and scoring (no stored logprob_scale on a flat rollout: the plain kernel)
    with torch.no_grad():
        again = recompute(policy, batch, "flow_sde")
    assert torch.equal(again.log_prob, out.log_prob.view(B, T)) and torch.equal(again.mean, out.mean)


def test_shared_initial_noise_per_group(policy):
    sig = sigma_schedule(N)
    seeds = torch.arange(4)
    shared = torch.tensor([77, 77, 78, 78])
    batch = rollout(policy, [digit_prompt(1)] * 4, seeds, sig, init_seeds=shared, kernel="flow_sde")
    first = sample_noise(shared, INIT_STEP, (64,))
    assert torch.equal(first[0], first[1])
    # same start, different step noise: the trajectories diverge
    assert not torch.equal(batch.x_final[0], batch.x_final[1])
    ode = rollout(policy, [digit_prompt(1)] * 4, seeds, sig, init_seeds=shared, kernel="ode")
    # exact: rows 0 and 1 are the same inputs in one batch (one kernel block of rows: the same op order)
    assert torch.equal(ode.x_final[0], ode.x_final[1]) and not torch.equal(ode.x_final[1], ode.x_final[2])


def test_ode_rollout_equals_a_hand_written_euler_loop(policy):
    sig = sigma_schedule(N, shift=2.0)
    seeds = torch.arange(3)
    batch = rollout(policy, prompts(3), seeds, sig, kernel="ode")
    x = sample_noise(seeds, INIT_STEP, (64,))
    cond = policy.encode(prompts(3))
    with torch.no_grad():
        for i in range(N):
            x = x + (sig[i + 1] - sig[i]) * policy.velocity(x, sig[i].expand(3), cond)
    torch.testing.assert_close(batch.x_final, x, rtol=0, atol=1e-6)  # Euler written out: fp32 in another op order
    assert batch.x.shape == (3, 0, 64)  # nothing trained, nothing stored


def test_sde_only_on_masked_steps(policy):
    sig = sigma_schedule(N)
    window = fixed_window(N, 2, 2)
    a = rollout(policy, prompts(3), torch.arange(3), sig, kernel="flow_sde", sde_mask=window)
    b = rollout(policy, prompts(3), torch.arange(3), sig, kernel="flow_sde", sde_mask=window)
    c = rollout(policy, prompts(3), torch.arange(3, 6), sig, kernel="flow_sde", sde_mask=window,
                init_seeds=torch.arange(3))
    assert torch.equal(a.x_final, b.x_final)
    assert not torch.equal(a.x_final, c.x_final)  # only the window's noise differs, and it matters


def test_train_mask_outside_sde_mask_is_refused(policy):
    sig = sigma_schedule(N)
    with pytest.raises(ValueError, match="not stochastic"):
        rollout(policy, prompts(2), torch.arange(2), sig, sde_mask=fixed_window(N, 0, 2), train_mask=fixed_window(N, 1, 2))


def test_noise_drawn_at_once_or_per_step_is_the_same(policy, monkeypatch):
    import difrl.rollout as ro

    sig = sigma_schedule(N)
    kw = dict(kernel="flow_sde", sde_mask=all_but_last(N), train_mask=all_but_last(N))
    at_once = rollout(policy, prompts(), torch.arange(6), sig, **kw)
    monkeypatch.setattr(ro, "_ONE_DRAW_MAX_ELEMENTS", 0)  # force the per-step path (large latents)
    per_step = rollout(policy, prompts(), torch.arange(6), sig, **kw)
    assert torch.equal(at_once.x_final, per_step.x_final) and torch.equal(at_once.log_prob_old, per_step.log_prob_old)

"""Counter-based noise (difrl.utils.rng): reproducible per (seed, step) and a good standard normal.

    pytest tests/test_rng.py -q
"""

import math

import pytest
import torch

from difrl.utils.rng import counter_normal, mix_seed, mix_seed_tensor


def test_tensor_mix_seed_is_bit_identical_to_the_python_one():
    seeds = torch.tensor([0, 1, 2, -1, -5, 2**62, 2**63 - 1, -(2**63), 123456789])
    for step in (-1, 0, 7, 10**6):
        assert mix_seed_tensor(seeds, step).tolist() == [mix_seed(int(s), step) for s in seeds]
    assert mix_seed_tensor(seeds, 3, 4).tolist() == [mix_seed(int(s), 3, 4) for s in seeds]
    assert all(0 <= mix_seed(s, 1) < 2**63 for s in range(100))


def test_rows_depend_only_on_seed_and_step():
    a = counter_normal(torch.tensor([4, 9, 2]), 5, (3, 5))
    b = counter_normal(torch.tensor([2, 4]), 5, (3, 5))
    assert a.shape == (3, 3, 5) and a.dtype == torch.float32
    assert torch.equal(a[0], b[1]) and torch.equal(a[2], b[0])
    assert not torch.equal(a[0], counter_normal(torch.tensor([4]), 6, (3, 5))[0])
    # odd element counts: a prefix of the longer draw (pairs are filled in order)
    assert torch.equal(counter_normal(torch.tensor([4]), 5, (7,))[0], counter_normal(torch.tensor([4]), 5, (8,))[0, :7])


def test_is_a_standard_normal():
    z = counter_normal(torch.arange(2000), 11, (500,)).double().flatten()  # 1M draws
    n = z.numel()
    assert abs(float(z.mean())) < 5 / math.sqrt(n)
    assert float(z.var()) == pytest.approx(1.0, abs=5 * math.sqrt(2 / n))
    # standard errors over n = 1M draws: sqrt(15 / n) = 0.004 and sqrt(96 / n) = 0.01; the seeded draws are fixed
    assert float((z**3).mean()) == pytest.approx(0.0, abs=0.01)
    assert float((z**4).mean()) == pytest.approx(3.0, abs=0.03)
    # the normal CDF at a few points (Kolmogorov-style check on the empirical distribution)
    for q in (-2.0, -1.0, 0.0, 0.5, 1.5, 2.5):
        want = 0.5 * (1 + math.erf(q / math.sqrt(2)))
        assert float((z <= q).double().mean()) == pytest.approx(want, abs=2e-3)  # 4 x sqrt(p (1 - p) / n) at most


def test_no_correlation_between_neighbours_rows_or_steps():
    z = counter_normal(torch.arange(1000), 0, (256,)).double()
    zn = counter_normal(torch.arange(1000), 1, (256,)).double()
    corr = lambda a, b: float(((a - a.mean()) * (b - b.mean())).mean() / (a.std() * b.std()))
    bound = 5 / math.sqrt(z.numel() / 2)
    assert abs(corr(z[:, :-1].flatten(), z[:, 1:].flatten())) < bound  # within a Box-Muller pair and across pairs
    assert abs(corr(z[:-1].flatten(), z[1:].flatten())) < bound  # consecutive seeds
    assert abs(corr(z.flatten(), zn.flatten())) < bound  # consecutive steps
    assert abs(corr(z[:, 0::2].flatten() ** 2, z[:, 1::2].flatten() ** 2)) < bound  # pair halves independent


def test_many_steps_in_one_call_equal_single_step_draws():
    seeds = torch.tensor([3, 8, 1])
    many = counter_normal(seeds, [0, 4, -1], (2, 5))
    assert many.shape == (3, 3, 2, 5)
    for s, step in enumerate([0, 4, -1]):
        assert torch.equal(many[s], counter_normal(seeds, step, (2, 5)))

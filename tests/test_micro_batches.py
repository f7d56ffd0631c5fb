"""The micro-batch solver both plans share (difrl/train/micro_batches.py): the values it offers cut the rollout as the
config asks, are the nearest to the config's, and read as the plans' errors quote them (tests/test_micro_batch.py,
tests/test_masked_dp.py check the errors themselves).

    .venv/bin/python -m pytest tests/test_micro_batches.py -q
"""

from __future__ import annotations

import itertools
import re

from difrl.train.micro_batches import (auto_options, divisors, either, explicit_options, nearest, own_updates,
                                       updates_options)


def _values(option: str) -> tuple[str, list[int], dict[str, int]]:
    """'train.k=a or b (with train.j=c)' -> ('k', [a, b], {'j': c})."""
    key, values = re.match(r"train\.([a-z_]+)=([0-9]+(?: or [0-9]+)*)", option).groups()
    kept = {k: int(v) for k, v in re.findall(r"\(with train\.([a-z_]+)=([0-9]+)\)", option)}
    return key, [int(v) for v in values.split(" or ")], kept


def test_divisors_nearest_either():
    assert divisors(12) == [1, 2, 3, 4, 6, 12] and divisors(1) == [1] and divisors(0) == [] and divisors(-4) == []
    assert nearest([4, 8], 6) == [4, 8] and nearest([4, 8], 4) == [4]  # x itself when valid
    assert nearest([4, 8], 10) == [8] and nearest([4, 8], 1) == [4] and nearest([], 3) == []
    assert either("grad_accum", [2, 4]) == "train.grad_accum=2 or 4"
    assert own_updates(4) == "train.updates_per_epoch=4 (or null) to take these"


def test_the_plans_quoted_options():
    # the numbers of tests/test_masked_dp.py's errors: 64 sequences, auto with 2 x 3; 48 x 1; 32 x 1 for 2 updates
    assert auto_options(64, 2, 3) == ["train.grad_accum=2 or 4"]  # no updates_per_epoch: 3 does not divide 64
    assert explicit_options(64, 48, 1, None, "AUTO") == ["train.micro_batch=32 or 64 (with train.grad_accum=1)", "AUTO"]
    assert explicit_options(64, 48, 1, None) == ["train.micro_batch=32 or 64 (with train.grad_accum=1)"]
    assert updates_options(128, 32, 1, 2) == ["train.grad_accum=2 (with train.micro_batch=32)",
                                              "train.micro_batch=64 (with train.grad_accum=1)"]
    assert updates_options(128, 32, 1, 2, whole=3) == ["train.grad_accum=2 (with train.micro_batch=32)"]  # 64 % 3


def test_every_auto_option_splits_the_units_and_is_the_nearest():
    for n, U, ga in itertools.product(range(1, 41), range(1, 5), range(1, 7)):
        options = auto_options(n, U, ga)
        for option in options:
            key, values, _ = _values(option)
            times = U if key == "grad_accum" else ga  # the key the option keeps
            assert all(n % (v * times) == 0 for v in values), (n, U, ga, option)
            fits = [v for v in range(1, n + 1) if n % (v * times) == 0]  # every value that splits, by brute force
            assert values == nearest(fits, ga if key == "grad_accum" else U), (n, U, ga, option)
        assert len(options) == (n % U == 0) + (n % ga == 0), (n, U, ga, options)


def test_every_explicit_option_cuts_the_units_in_whole_micro_batches_and_the_wanted_updates():
    for X, mb, ga, want, whole in itertools.product(range(1, 49), (1, 3, 5, 8), (1, 2, 3), (None, 1, 2), (1, 2, 3)):
        for option in explicit_options(X, mb, ga, want, whole=whole):
            key, values, kept = _values(option)
            for v in values:
                m, g = (v, kept["grad_accum"]) if key == "micro_batch" else (kept["micro_batch"], v)
                assert X % (m * g) == 0 and m % whole == 0 and want in (None, X // (m * g)), (X, mb, ga, want, option)
        for option in updates_options(X, mb, ga, want, whole) if want is not None else []:
            key, (v,), kept = _values(option)  # a new micro_batch is whole; grad_accum keeps the config's micro_batch
            m, g = (v, kept["grad_accum"]) if key == "micro_batch" else (kept["micro_batch"], v)
            assert X // (m * g) == want and X % (m * g) == 0 and (key == "grad_accum" or m % whole == 0), option

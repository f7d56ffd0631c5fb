"""pass@k (difrl/eval/passk.py): the unbiased estimator against hand-computed values and brute force,
and Sudoku pass@1 / pass@8 of the bundled weak base with the training sampler, plus `difrl eval --pass-k`.

    HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q tests/test_eval_passk.py
"""

from __future__ import annotations

import itertools
import json
from math import comb
from pathlib import Path

import numpy as np
import pytest
import torch

from difrl.discrete.samplers import SAMPLERS
from difrl.eval.passk import masked_pass_at_k, pass_at_k, pass_at_k_many, pass_at_k_per_problem
from difrl.train.masked.config import load_masked_config
from difrl.utils.rng import mix_seed
from difrl.worlds import build_masked_world
from difrl.worlds.sudoku import decode, eval_prompts, evaluate_sudoku, solved_fn

torch.set_num_threads(1)
CONFIG = str(Path(__file__).resolve().parent.parent / "configs" / "sudoku.yaml")


# ----------------------------------------------------------------------------- the estimator
@pytest.mark.parametrize("n,c,k,want", [
    (5, 2, 1, 0.4),  # c / n
    (5, 2, 2, 1 - comb(3, 2) / comb(5, 2)),  # 1 - 3/10 = 0.7
    (10, 0, 1, 0.0), (10, 0, 10, 0.0),  # nothing correct
    (10, 10, 1, 1.0), (10, 10, 10, 1.0),  # everything correct
    (5, 4, 2, 1.0), (8, 3, 6, 1.0),  # n - c < k: every k-subset holds a correct one
    (8, 1, 8, 1.0), (8, 1, 1, 0.125), (8, 2, 4, 1 - comb(6, 4) / comb(8, 4)),  # 1 - 15/70
    (1, 1, 1, 1.0), (1, 0, 1, 0.0),
])
def test_hand_computed(n, c, k, want):  # float64 products of a few ratios: ~1e-15, hence abs 1e-12
    assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)
    assert pass_at_k_many([n], [c], k) == pytest.approx(want, abs=1e-12)


def test_hand_computed_exact_values():
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7, abs=1e-15)
    assert pass_at_k(10, 0, 3) == 0.0
    assert pass_at_k(5, 4, 2) == 1.0


@pytest.mark.parametrize("n,c,k", [(5, 2, 6), (1, 0, 2), (5, 2, 0), (5, 2, -1), (5, 6, 1), (5, -1, 1), (0, 0, 1)])
def test_invalid_raises(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)
    with pytest.raises(ValueError):
        pass_at_k_many([n], [c], k)


def test_k_above_some_n_raises():
    with pytest.raises(ValueError, match="k=8 > n=4"):
        pass_at_k_many([8, 4], [1, 1], 8)  # never a silent 0 for the short problem
    with pytest.raises(ValueError):
        pass_at_k_many([8, 8], [1], 1)
    with pytest.raises(ValueError):
        pass_at_k_many([], [], 1)


def test_matches_brute_force_over_all_k_subsets():
    """E over every k-subset of n samples (the first c correct) of [the subset holds a correct one]."""
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))
                brute = sum(any(i < c for i in s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_stable_for_large_n_and_vectorised():
    # the product form against exact big-integer binomials where C(n, k) overflows a float
    for n, c, k in [(200, 37, 10), (1000, 5, 100), (2000, 1999, 1000), (1200, 3, 600)]:
        exact = 1 - comb(n - c, k) / comb(n, k) if n - c >= k else 1.0
        assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-10, abs=1e-15)
    rng = np.random.default_rng(0)
    n = rng.integers(8, 40, size=50)
    c = np.array([rng.integers(0, m + 1) for m in n])
    per = pass_at_k_per_problem(n, c, 8)
    assert per.shape == (50,)
    np.testing.assert_allclose(per, [pass_at_k(a, b, 8) for a, b in zip(n, c)], atol=1e-12)
    assert pass_at_k_many(n, c, 8) == pytest.approx(per.mean(), rel=1e-12)  # float64 means in another order
    assert pass_at_k_many(n, c, 1) == pytest.approx(float((c / n).mean()), abs=1e-12)  # pass@1 = mean of c / n


# ----------------------------------------------------------------------------- Sudoku on the weak base
@pytest.fixture(scope="module")
def sudoku():
    cfg = load_masked_config(CONFIG)
    return cfg, build_masked_world(cfg)


def _run(sudoku, **kw):
    cfg, world = sudoku
    args = dict(sampler=cfg.sampler.kind, sampler_kwargs=cfg.sampler.sampler_kwargs(), n=8, ks=[1, 8], temperature=1.0,
                seed=1234, problems=16, correct_fn=solved_fn) | kw
    return masked_pass_at_k(world, world.policy, **args)


def test_sudoku_pass_at_k_consistent_and_recorded(sudoku):
    res = _run(sudoku)
    c = np.array(res["correct_per_problem"])
    assert c.shape == (16,) and ((0 <= c) & (c <= 8)).all()
    assert res["pass@1"] == pytest.approx(float(c.sum()) / (16 * 8), abs=1e-12)  # the mean solve rate of the samples
    assert res["pass@8"] == pytest.approx(float((c > 0).mean()), abs=1e-12)  # k = n: some sample solved it
    assert res["pass@8"] > res["pass@1"]  # the weak base solves some puzzles only sometimes
    for key, want in [("n", 8), ("n_requested", 8), ("ks", [1, 8]), ("greedy", False), ("temperature", 1.0),
                      ("sampler", "llada"), ("remasking", "low_confidence"), ("steps", 16), ("block_length", None),
                      ("problems", 16), ("samples", 128), ("seed", 1234)]:
        assert res[key] == want, key
    assert res["sampler_kwargs"] == {"steps": 16, "block_length": None, "temperature": 1.0}
    assert res["nfe"] > 0


def test_sudoku_reproducible_and_batch_independent(sudoku):
    a, b = _run(sudoku), _run(sudoku, batch=13)
    assert a == b
    other = _run(sudoku, seed=99)
    assert other["correct_per_problem"] != a["correct_per_problem"]


def test_sudoku_seeds_are_per_problem_and_sample(sudoku):
    """Sample j of problem p is the training sampler's rollout with seed mix_seed(seed, p, j)."""
    cfg, world = sudoku
    res = _run(sudoku)
    prompts = eval_prompts(count=16)
    for p in (0, 5, 15):
        one = prompts.select(torch.tensor([p])).repeat(8)
        seeds = torch.tensor([mix_seed(1234, p, j) for j in range(8)])
        out = SAMPLERS["llada"](world.policy, one.tokens, one.cond, seeds=seeds, **cfg.sampler.sampler_kwargs())
        assert int(solved_fn(decode(out.tokens), one).sum()) == res["correct_per_problem"][p]


def test_sudoku_greedy_is_one_sample_and_matches_evaluate(sudoku):
    cfg, world = sudoku
    res = _run(sudoku, temperature=0.0, correct_fn=None)  # correct_fn None: Sudoku's default verifier
    assert res["greedy"] and res["n"] == 1 and res["n_requested"] == 8 and res["samples"] == 16 and "note" in res
    assert res["pass@1"] == res["pass@8"]
    assert res["pass@1"] == pytest.approx(evaluate_sudoku(world.policy, count=16)[0]["solve_rate"], rel=1e-12)  # k / 16
    assert "solved" in res["metric"]
    # emerge at T = 0 still varies with the seed (who unmasks when): real samples, not greedy
    emerge = _run(sudoku, sampler="emerge", sampler_kwargs={"steps": 8, "schedule": "cosine"}, temperature=0.0, n=2,
                  ks=[1, 2], problems=4)
    assert not emerge["greedy"] and emerge["n"] == 2 and emerge["remasking"].startswith("mdlm_ancestral")
    eb = _run(sudoku, sampler="eb", sampler_kwargs={"gamma": 0.1}, n=2, ks=[1], problems=4)
    assert eb["steps"] is None and eb["remasking"].startswith("entropy_bound(gamma=0.1")


def test_sudoku_bad_arguments(sudoku):
    with pytest.raises(ValueError, match="k=16 > n=8"):
        _run(sudoku, ks=[1, 16])
    with pytest.raises(ValueError, match="problems"):
        _run(sudoku, problems=10_000)
    with pytest.raises(ValueError, match="unknown sampler"):
        _run(sudoku, sampler="nope")
    cfg, world = sudoku
    with pytest.raises(ValueError, match="verdicts"):
        _run(sudoku, correct_fn=lambda samples, batch: torch.ones(1, dtype=torch.bool), problems=2)


# ----------------------------------------------------------------------------- difrl eval --pass-k
def test_cli_eval_pass_k(capsys):
    from difrl.cli import main

    base = ["eval", CONFIG, "eval.count=8", "threads=1"]  # (argparse: positionals before the flags)
    argv = base + ["--pass-k", "1,4", "--samples", "4", "--problems", "8", "--json"]  # --json: the JSON printed
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    pk = out["pass_at_k"]
    assert {"solve_rate", "cell_accuracy"} <= set(out)
    assert pk["n"] == 4 and pk["ks"] == [1, 4] and pk["problems"] == 8 and pk["temperature"] == 1.0  # the config's T
    assert pk["sampler"] == "llada" and pk["steps"] == 16 and pk["pass@1"] <= pk["pass@4"]  # pass@k grows with k
    assert main(argv + ["--temperature", "0"]) == 0
    greedy = json.loads(capsys.readouterr().out)["pass_at_k"]
    assert greedy["greedy"] and greedy["pass@1"] == pytest.approx(out["solve_rate"], rel=1e-12)  # a count / 8, float64
    assert main(base + ["--pass-k", "16", "--samples", "8"]) == 2
    assert "k=16 > n=8" in capsys.readouterr().err
    assert main(base + ["--samples", "8"]) == 2

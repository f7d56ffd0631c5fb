"""DTS / DTS* / best-of-N (difrl.search) and `difrl sample` on the bundled digits generator.

    .venv/bin/python -m pytest tests/test_search.py -q
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from difrl.algos.tree import soft_mean
from difrl.cli import main
from difrl.models.digits import DigitsPolicy
from difrl.rollout import INIT_STEP, sample_noise
from difrl.samplers import KERNELS, sigma_schedule
from difrl.search import SearchConfig, best_of_n, dts
from difrl.samplers.kernels import ode_step

N = 5
PROMPT = "a handwritten 3"


@pytest.fixture(scope="module")
def policy():
    return DigitsPolicy.from_checkpoint()


def brightness(images: torch.Tensor, prompt: str) -> torch.Tensor:  # a cheap deterministic reward, [B]
    return images.flatten(1).mean(1) * 10


def test_budget_and_node_accounting(policy):
    cfg = SearchConfig(budget=37, children=2, root_children=3)
    t = dts(policy, PROMPT, brightness, sigma_schedule(N), cfg, seed=1)
    assert t.nfe <= 37 and t.nfe > 37 - N  # an iteration that would overshoot is not started
    # every node below the initial noises cost one evaluation; the initial noises cost none
    assert t.nfe == sum(d >= 1 for d in t.depth)
    assert len(t.kids[0]) <= 3 and all(len(k) <= 2 for k in t.kids[1:])
    assert all(t.depth[n] == N for n in t.leaves) and len(t.leaves) == len(t.rewards)
    with pytest.raises(ValueError, match="cannot pay for one"):
        dts(policy, PROMPT, brightness, sigma_schedule(N), SearchConfig(budget=N - 1), seed=1)


def test_nodes_are_pure_functions_of_seed_and_path(policy):
    sig = sigma_schedule(N)
    cfg = SearchConfig(budget=40)
    t = dts(policy, PROMPT, brightness, sig, cfg, seed=7)
    again = dts(policy, PROMPT, brightness, sig, cfg, seed=7)
    assert t.rewards == again.rewards and t.parent == again.parent
    # recompute a leaf from its path by hand: the seeds follow the path, the last step is the Euler step
    leaf = t.leaves[-1]
    path = []
    n = leaf
    while n > 0:
        path.append(n)
        n = t.parent[n]
    path = path[::-1]  # initial noise, then one node per step
    x = sample_noise(torch.tensor([t.seed[path[0]]]), INIT_STEP, (64,))
    cond = policy.encode([PROMPT])
    with torch.no_grad():
        for d, node in enumerate(path[1:]):
            v = policy.velocity(x, sig[d].view(1), cond)
            if d < N - 1:
                x = KERNELS["flow_sde"](x, v, sig[d].view(1), sig[d + 1].view(1), sample_noise(torch.tensor([t.seed[node]]), d, (64,)),
                                        noise_level=0.7).x_next
            else:
                x = ode_step(x, v, sig[d].view(1), sig[d + 1].view(1)).x_next
    torch.testing.assert_close(x[0], t.latents[leaf], rtol=0, atol=1e-6)  # one row vs the tree's batches: fp32


def test_soft_values_back_up(policy):
    t = dts(policy, PROMPT, brightness, sigma_schedule(N), SearchConfig(budget=60, lam=2.0), seed=3)
    for n, kids in enumerate(t.kids):
        if kids:
            expect = math.log(sum(math.exp(2.0 * t.value[c]) for c in kids) / len(kids)) / 2.0
            assert t.value[n] == pytest.approx(expect, rel=1e-9, abs=1e-9)
    v = torch.tensor([0.1, 0.5, 0.9])
    assert soft_mean(v, 1e-6) == pytest.approx(0.5, abs=1e-6)  # lam -> 0: the mean (BranchGRPO's fusion)
    assert soft_mean(v, 1e4) == pytest.approx(0.9, abs=1e-3)  # lam -> inf: the max


def test_dts_star_returns_its_best_leaf_and_dts_samples_follow_the_values(policy):
    sig = sigma_schedule(N)
    star = dts(policy, PROMPT, brightness, sig, SearchConfig(budget=60), seed=5, star=True)
    assert star.best_reward == max(star.rewards)
    torch.testing.assert_close(brightness(policy.decode(star.best[None]), PROMPT)[0], torch.tensor(star.best_reward),
                               rtol=1e-5, atol=1e-6)  # decoded and scored alone, not in the search's batch: fp32
    t = dts(policy, PROMPT, brightness, sig, SearchConfig(budget=60, lam=1e3), seed=5)
    _, nodes = t.samples(5)  # a huge lam: every descent takes the highest-value child, i.e. the best leaf
    assert {t.value[n] for n in nodes} == {max(t.rewards)}


def test_best_of_n(policy):
    out = best_of_n(policy, PROMPT, brightness, sigma_schedule(N), n=6, seed=2)
    assert out["nfe"] == 6 * N and out["best_reward"] == float(out["rewards"].max())


def test_search_config_and_reward_errors(policy):
    with pytest.raises(ValueError, match="stochastic kernel"):
        SearchConfig(kernel="ode")
    with pytest.raises(ValueError, match="lam"):
        SearchConfig(lam=0)
    nan = lambda images, prompt: torch.full((len(images),), float("nan"))  # noqa: E731
    with pytest.raises(ValueError, match="returned nan for prompt 'a handwritten 3'"):
        dts(policy, PROMPT, nan, sigma_schedule(N), SearchConfig(budget=20), seed=0)


@pytest.mark.parametrize("search", ["none", "best-of-n", "dts", "dts-star"])
def test_cli_sample(tmp_path, capsys, search):
    grid = tmp_path / "g.png"
    assert main(["sample", "configs/digits.yaml", "sampler.num_steps=4", "--search", search, "--budget", "16",
                 "--samples", "3", "--prompt", "a handwritten 3", "--prompt", "a handwritten 7", "--grid", str(grid)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["prompt"] for r in out["results"]] == ["a handwritten 3", "a handwritten 7"]
    for r in out["results"]:
        assert r["nfe"] <= 16 if search != "none" else r["nfe"] == 12
        assert r["samples"] == (1 if search in ("best-of-n", "dts-star") else 3)
    assert grid.is_file()

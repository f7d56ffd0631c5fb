"""pass@k for masked (discrete) diffusion worlds: the unbiased estimator and a sampler-faithful eval.

    from difrl.eval.passk import pass_at_k, pass_at_k_many, masked_pass_at_k
    pass_at_k(n=5, c=2, k=2)                                   # 0.7 = 1 - C(3, 2) / C(5, 2)
    pass_at_k_many([8, 8, 16], [0, 3, 16], k=8)                # mean over problems (n may differ)
    res = masked_pass_at_k(world, world.policy, cfg.sampler.kind, cfg.sampler.sampler_kwargs(), n=8, ks=[1, 8],
                           temperature=1.0, seed=1234, problems=64)   # the world's Verifier: its set, its check
    res["pass@1"], res["pass@8"], res["n"], res["greedy"], res["steps"], res["remasking"], ...

    difrl eval configs/sudoku.yaml --pass-k 1,8 --samples 8 [--temperature 1.0] [--problems 64]

The estimator (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1; the
same product form as openai/human-eval ``human_eval/evaluation.py`` ``estimate_pass_at_k``): with n
samples of a problem of which c are correct, pass@k = E over k-subsets [any correct] =
1 - C(n - c, k) / C(n, k), computed without big binomials as 1 - prod_{i = n-c+1}^{n} (1 - k / i);
it is exactly 1 when n - c < k (every k-subset holds a correct sample). Unlike some copies, k > n
is an error here, never 0 (docs/reference/specs/rewards-eval.md §3.5). pass@1 is the mean of c / n, i.e.
the mean over the n samples, not one greedy sample.

``masked_pass_at_k`` draws n completions per evaluation problem with the *training* rollout
sampler (``difrl.discrete.samplers.SAMPLERS[sampler]`` with the kwargs of
``MaskedSamplerConfig.sampler_kwargs()``, exactly the call in difrl/train/masked/trainer.py; eval equals
the train path), policy in eval mode. Sample j of problem p has seed ``mix_seed(seed, p, j)``; the
samplers' randomness is counter-based per sample, so results do not depend on the batch size.
Each sample is judged by ``correct_fn(samples, batch) -> [N] bool`` on the world's decoded samples
(default: the world's ``verifier``; Sudoku's is ``solved``, the whole grid valid). The result records n, ks, temperature, sampler,
remasking strategy, steps, block length, every sampler kwarg and the mean forward passes.

Greedy: at temperature 0 with a deterministic sampler (LLaDA low-confidence remasking, EB-Sampler)
all n samples of a problem are identical, so ONE sample per problem is drawn and the result says
``greedy: True, n: 1`` (``n_requested`` keeps the asked-for n); every pass@k then equals the greedy
solve rate (k copies of one deterministic answer), labelled as such. At temperature 0 the MDLM
``emerge`` sampler and LLaDA ``remasking=random`` still vary with the seed (who unmasks when), so
they draw n real samples and are not greedy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from difrl.utils.rng import mix_seed


# ----------------------------------------------------------------------------- the estimator
def _check(n: int, c: int, k: int) -> None:
    if n < 1:
        raise ValueError(f"pass@k needs n >= 1 samples, got n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k: c={c} correct samples must lie in [0, n={n}]")
    if k < 1:
        raise ValueError(f"pass@k: k must be >= 1, got {k}")
    if k > n:
        raise ValueError(f"pass@k: k={k} > n={n} samples; the unbiased estimator needs n >= k (draw more samples)")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with n samples, c correct: 1 - C(n-c, k) / C(n, k)
    (Chen et al. 2021), as 1 - prod_{i=n-c+1}^{n} (1 - k/i); 1.0 when n - c < k. ValueError for
    k > n, k < 1, or c outside [0, n]."""
    n, c, k = int(n), int(c), int(k)
    _check(n, c, k)
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def pass_at_k_per_problem(n_per_problem: Sequence[int] | np.ndarray, c_per_problem: Sequence[int] | np.ndarray,
                          k: int) -> np.ndarray:
    """[P] fp64 unbiased pass@k per problem; n and c are [P] ints (n may differ between problems)."""
    n = np.asarray(n_per_problem, dtype=np.int64).reshape(-1)
    c = np.asarray(c_per_problem, dtype=np.int64).reshape(-1)
    if n.shape != c.shape:
        raise ValueError(f"pass@k: {n.size} sample counts for {c.size} correct counts")
    if n.size == 0:
        raise ValueError("pass@k of no problems")
    for ni, ci in zip(n.tolist(), c.tolist()):
        _check(ni, ci, k)
    # the product over i in (n - c, n], padded to [P, max n] with factors 1 outside each row's range
    i = np.arange(1, int(n.max()) + 1, dtype=np.float64)[None, :]  # [1, max n]
    inside = (i > (n - c)[:, None]) & (i <= n[:, None])  # [P, max n]
    prod = np.where(inside, 1.0 - k / i, 1.0).prod(axis=1)  # [P]
    return np.where(n - c < k, 1.0, 1.0 - prod)


def pass_at_k_many(n_per_problem: Sequence[int] | np.ndarray, c_per_problem: Sequence[int] | np.ndarray, k: int) -> float:
    """Mean over problems of the unbiased pass@k; n and c are [P] ints (n may differ per problem)."""
    return float(pass_at_k_per_problem(n_per_problem, c_per_problem, k).mean())


# ----------------------------------------------------------------------------- a world's evaluation problems
@dataclass(frozen=True)
class Verifier:
    """A masked world's default pass@k set (``MaskedWorld.verifier``): its fixed evaluation problems and the
    check of a sample (Sudoku: the test puzzles and ``solved``; difrl/worlds/sudoku.py)."""
    prompts: Callable[[], object]  # () -> MaskedPrompts of the evaluation problems
    correct: Callable  # (samples [N, ...], MaskedPrompts [N]) -> [N] bool
    metric: str  # what correct means, recorded with the numbers


# ----------------------------------------------------------------------------- pass@k of a masked policy
def _settings(sampler: str, kw: dict) -> dict:
    """What to record next to the numbers: remasking strategy, steps, block length (spec section 3.5)."""
    if sampler == "llada":
        remasking = kw.get("remasking", "low_confidence")
        steps = kw.get("steps")
    elif sampler == "eb":
        remasking = f"entropy_bound(gamma={kw.get('gamma', 0.1)}, order={kw.get('order', 'entropy')})"
        steps = None  # adaptive: see "nfe"
    elif sampler == "emerge":
        remasking = f"mdlm_ancestral(schedule={kw.get('schedule', 'cosine')})"
        steps = kw.get("steps", 12)
    else:
        remasking, steps = kw.get("remasking"), kw.get("steps")
    return {"remasking": remasking, "steps": steps, "block_length": kw.get("block_length")}


def _deterministic(sampler: str, kw: dict, temperature: float) -> bool:
    """True when every seed gives the same rollout: T = 0 and the commit order depends on the logits only."""
    if temperature > 0:
        return False
    return sampler == "eb" or (sampler == "llada" and kw.get("remasking", "low_confidence") == "low_confidence")


def masked_pass_at_k(world, policy, sampler: str, sampler_kwargs: dict, n: int, ks: Sequence[int], temperature: float,
                     seed: int, problems: int | None = None, correct_fn: Callable | None = None, *, prompts=None,
                     batch: int = 512, per_problem: bool = True) -> dict:
    """pass@k of `policy` on the world's evaluation problems, sampled with the training sampler.

    world: a MaskedWorld (its ``decode`` turns tokens into what ``correct_fn`` judges); sampler: a
    key of SAMPLERS ("llada", "eb", "emerge"); sampler_kwargs: ``cfg.sampler.sampler_kwargs()``
    (its temperature is replaced by `temperature`); n samples per problem; ks: the k of pass@k
    (each 1 <= k <= n); seed: sample j of problem p uses mix_seed(seed, p, j); problems: the first
    `problems` evaluation problems (None = all); correct_fn(samples [N, ...], MaskedPrompts [N]) ->
    [N] bool (None = ``world.verifier.correct``: Sudoku ``solved``); prompts: the evaluation
    problems as MaskedPrompts (None = ``world.verifier.prompts()``: Sudoku's fixed test puzzles); batch:
    rows per sampler call (results do not depend on it).

    Returns {"pass@k" for k in ks, "n", "n_requested", "ks", "greedy", "temperature", "sampler",
    "remasking", "steps", "block_length", "sampler_kwargs", "problems", "samples", "nfe", "seed",
    "metric", "correct_per_problem" (if per_problem)}."""
    from difrl.discrete.samplers import SAMPLERS

    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}; known: {', '.join(SAMPLERS)}")
    n = int(n)
    ks = [int(k) for k in ks]
    if not ks:
        raise ValueError("pass@k: give at least one k")
    for k in ks:
        _check(n, 0, k)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    default = getattr(world, "verifier", None)
    metric = getattr(correct_fn, "__name__", "correct_fn")
    if prompts is None or correct_fn is None:
        if default is None:
            raise ValueError(f"pass@k on the masked world {getattr(world, 'name', world)!r} needs prompts= and "
                             "correct_fn= (a verifier): the world has no default set (MaskedWorld.verifier)")
        prompts = default.prompts() if prompts is None else prompts
        if correct_fn is None:
            correct_fn, metric = default.correct, default.metric
    total = len(prompts)
    P = total if problems is None else int(problems)
    if not 1 <= P <= total:
        raise ValueError(f"problems={problems} must lie in [1, {total}] (the evaluation set's size)")
    kw = dict(sampler_kwargs) | {"temperature": float(temperature)}
    greedy = _deterministic(sampler, kw, float(temperature))
    m = 1 if greedy else n  # samples actually drawn per problem

    # rows r = p * m + j: problem p, sample j; seeds [P * m]
    rows = prompts.select(torch.arange(P)).repeat(m)
    seeds = torch.tensor([mix_seed(seed, p, j) for p in range(P) for j in range(m)], dtype=torch.int64)
    net = policy.module
    was_training = net.training
    net.eval()
    correct, nfe = [], []
    try:
        for lo in range(0, P * m, batch):
            idx = torch.arange(lo, min(lo + batch, P * m))
            part = rows.select(idx)
            out = SAMPLERS[sampler](policy, part.tokens, part.cond, seeds=seeds[idx], **kw)  # as difrl/train/masked/trainer.py
            ok = torch.as_tensor(correct_fn(world.decode(out.tokens), part)).reshape(-1)
            if ok.numel() != len(idx):
                raise ValueError(f"correct_fn returned {ok.numel()} verdicts for {len(idx)} samples")
            correct.append(ok.bool())
            nfe.append(out.nfe_per_sample.float())
    finally:
        net.train(was_training)
    c = torch.cat(correct).view(P, m).sum(1).numpy()  # [P] correct samples per problem
    res: dict = {}
    for k in ks:
        # greedy: one deterministic answer, so pass@k = its solve rate for every k
        res[f"pass@{k}"] = float((c / m).mean()) if greedy else pass_at_k_many(np.full(P, m), c, k)
    res |= {"n": m, "n_requested": n, "ks": ks, "greedy": greedy, "temperature": float(temperature), "sampler": sampler,
            **_settings(sampler, kw), "sampler_kwargs": kw, "problems": P, "samples": P * m,
            "nfe": float(torch.cat(nfe).mean()), "seed": int(seed), "metric": metric}
    if greedy:
        res["note"] = (f"greedy: temperature 0 with a deterministic {sampler} sampler gives identical samples, so one "
                       f"sample per problem was drawn (not {n}); every pass@k is the greedy solve rate")
    if per_problem:
        res["correct_per_problem"] = c.tolist()
    return res


__all__ = ["Verifier", "masked_pass_at_k", "pass_at_k", "pass_at_k_many", "pass_at_k_per_problem"]

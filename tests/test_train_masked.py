"""The masked-diffusion GRPO trainer (difrl/train/masked/trainer.py) end to end on tiny Sudoku runs (seconds each).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_train_masked.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from difrl.cli import main
from difrl.config import ConfigError
from difrl.discrete.losses import trace_logp, unigrpo_ratios
from difrl.discrete.samplers import llada_sample
from difrl.algos import group_normalize
from difrl.discrete.estimators import remask, token_logp
from difrl.train.masked.trainer import TIMING_KEYS, train
from difrl.train.masked.config import load_masked_config
from difrl.utils.io import load_safetensors_checked
from difrl.worlds import sudoku
# Exact float comparisons here are on token ids, masks, 0/1 fractions and rewards, or the same run twice in this
# process (a resume replays the same ops on the same inputs: bitwise); the others state their tolerance and why.
from tolerances import FP32_REORDER, MASKED_FIRST_STEP_LOG_RATIO

# 8 rollouts per iteration (2 puzzles x 4), 2 inner updates of 2 optimizer steps, a 16-puzzle eval
TINY = ["seed=3", "threads=1", "rollout.prompts_per_iter=2", "rollout.group_size=4", "train.micro_batch=4",
        "train.inner_updates=2", "train.iterations=1", "train.lr=1e-3", "eval.count=16", "eval.every=0"]

ESTIMATORS = {
    "maskgrpo_arlike": ("estimator.kind=maskgrpo", "estimator.remasking=arlike"),
    "maskgrpo_random": ("estimator.kind=maskgrpo", "estimator.remasking=random", "estimator.min_mask_rate=0.3"),
    "d1": ("estimator.kind=d1", "advantage.scale=mean"),
    "unigrpo": ("estimator.kind=unigrpo",),
    "coupled": ("estimator.kind=coupled", "advantage.scale=loo"),
    "coupled_no_full_kl": ("estimator.kind=coupled", "estimator.full_view=false", "train.kl_beta=0.05"),
    "maskgrpo_lora_kl": ("estimator.kind=maskgrpo", "train.lora.enabled=true", "train.kl_beta=0.05"),
}


def run(out: Path, *overrides: str) -> tuple[dict, Path]:
    return train(load_masked_config(None, [*TINY, *overrides]), out_dir=out), out


def metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_safetensors_checked(path, "test")[0]


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_first_micro_step_is_on_policy_and_prompt_never_masked(tmp_path, name):
    _, d = run(tmp_path / "r", "train.iterations=2", *ESTIMATORS[name])
    rows = metrics(d)
    assert len(rows) == 2
    for row in rows:
        # not 0: training recomputes in micro-batches of 4 what the rollout computed in one batch of 8 (tolerances.py)
        assert row["first_step_max_abs_log_ratio"] <= MASKED_FIRST_STEP_LOG_RATIO  # enforced too, by check_ratio
        assert row["prompt_masked_frac"] == 0.0  # the givens were never masked in any training input
        assert 0.0 < row["mask_frac"] <= 1.0
        assert row["trained_samples"] > 0
    if name.startswith("d1") or name.startswith("coupled"):
        assert rows[0]["mask_frac"] == 1.0  # d1's view masks every answer token (coupled: A + B cover them)


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_remask_is_a_function_of_seed_and_iteration(name):
    cfg = load_masked_config(None, [*TINY, *ESTIMATORS[name]])
    puzzles, _ = sudoku.sample_training_puzzles(6, (3, 9), seed=1)
    tokens, prompt = sudoku.encode(puzzles)
    answer = ~prompt
    tokens = torch.where(answer, torch.randint(0, 4, tokens.shape), tokens)
    seeds = torch.arange(6, dtype=torch.int64) * 7919 + 3
    full = [remask(cfg, tokens, answer, prompt, seeds, n, 0.37, sudoku.MASK_ID) for n in (1, 2)]
    for rm in full:
        assert not (rm.masked & prompt[None]).any()  # the prompt is never masked
        assert not (rm.loss_mask & prompt).any()
        assert (rm.inputs[rm.masked] == sudoku.MASK_ID).all()
        assert torch.equal(rm.inputs[0][prompt], tokens[prompt])
    if cfg.estimator.kind == "maskgrpo":  # a new mask per inner update
        assert not torch.equal(full[0].masked, full[1].masked)
    sub = torch.tensor([4, 1])  # any sub-batch (a micro-batch) sees the same masks as the full batch
    part = remask(cfg, tokens[sub], answer[sub], prompt[sub], seeds[sub], 2, 0.37, sudoku.MASK_ID)
    assert torch.equal(part.masked, full[1].masked[:, sub]) and torch.equal(part.loss_mask, full[1].loss_mask[sub])
    policy = sudoku.load_base()
    with torch.no_grad():
        lp_full = token_logp(cfg, policy, tokens, full[1])[sub]
        lp_part = token_logp(cfg, policy, tokens[sub], part)
    assert torch.allclose(lp_full, lp_part, atol=1e-6)  # fp32: a batch of 32 against its part (reordered matmuls)
    assert (lp_full[~full[1].loss_mask[sub]] == 0).all()


def test_d1_prompt_masking_is_the_only_prompt_masking():
    cfg = load_masked_config(None, [*TINY, "estimator.kind=d1", "estimator.p_mask_prompt=0.5"])
    puzzles, _ = sudoku.sample_training_puzzles(32, 6, seed=2)
    tokens, prompt = sudoku.encode(puzzles)
    rm = remask(cfg, tokens, ~prompt, prompt, torch.arange(32, dtype=torch.int64), 1, 0.5, sudoku.MASK_ID)
    assert (rm.masked[0] & prompt).any() and not (rm.loss_mask & prompt).any()  # masked input, never a loss target


def test_resume_continues_exactly(tmp_path):
    common = ("train.iterations=3", "checkpoint_every=1", "estimator.kind=maskgrpo")
    run(tmp_path / "a", *common)
    run(tmp_path / "b", "train.iterations=2", *common[1:])
    summary = train(load_masked_config(tmp_path / "b" / "config.yaml", ["train.iterations=3", f"resume={tmp_path / 'b'}"]))
    assert summary["iterations"] == 3
    assert metrics(tmp_path / "a") == metrics(tmp_path / "b")
    wa, wb = weights(tmp_path / "a" / "policy.safetensors"), weights(tmp_path / "b" / "policy.safetensors")
    assert set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)
    sa, sb = (json.loads((tmp_path / r / "summary.json").read_text()) for r in "ab")
    assert sa["eval_before"] == sb["eval_before"] and sa["eval_after"] == sb["eval_after"]


def test_unknown_or_bad_config_key_is_named(tmp_path, capsys):
    with pytest.raises(ConfigError, match="train.lrr"):
        load_masked_config(None, ["train.lrr=1e-3"])
    with pytest.raises(ConfigError, match="estimator.kind"):
        load_masked_config(None, ["estimator.kind=grpo"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  kind: sudoku\nestimator:\n  mask_rate: 0.5\n")
    assert main(["train", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "estimator.mask_rate" in err and "min_mask_rate" in err  # named, with the close match


def test_cli_routes_sudoku_to_the_masked_trainer_and_writes_artifacts(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "configs/sudoku.yaml", *TINY, "train.iterations=2", "eval.every=1", "checkpoint_every=1",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "cell_accuracy" in text and "solve_rate" in text
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "policy.safetensors", "reward_curve.png"):
        assert (out / name).is_file(), name
    assert (out / "checkpoints" / "latest").read_text().strip() == "iter-000002"
    summary = json.loads((out / "summary.json").read_text())
    for when in ("eval_before", "eval_after"):
        assert 0.0 <= summary[when]["cell_accuracy"] <= 1.0 and 0.0 <= summary[when]["solve_rate"] <= 1.0
    rows = metrics(out)
    assert [r["iteration"] for r in rows] == [1, 2] and "eval/cell_accuracy" in rows[0]
    assert load_masked_config(out / "config.yaml").train.iterations == 2
    # the trained policy is a plain checkpoint: model.path takes it, and it is the trained weights
    trained = sudoku.load_base(out / "policy.safetensors")
    again, _ = sudoku.evaluate_sudoku(trained, count=16)
    assert again["cell_accuracy"] == summary["eval_after"]["cell_accuracy"]


def test_cli_eval_of_the_sudoku_config(capsys):
    from difrl.cli import main

    assert main(["eval", "configs/sudoku.yaml", "eval.count=16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_puzzles"] == 16 and 0.0 <= out["cell_accuracy"] <= 1.0 and 0.0 <= out["solve_rate"] <= 1.0


# ---------------------------------------------------------------------------------- UniGRPO
def test_unigrpo_structured_ratios_follow_the_formula():
    seeds = torch.arange(64, dtype=torch.int64) * 31 + 5
    mu, T = 5, 1000
    r = torch.stack([unigrpo_ratios(seeds, n, mu, T) for n in range(1, mu + 1)])  # [mu, B]
    t1 = torch.floor(r[0] * T)
    for n in range(1, mu + 1):  # t_n = floor((n - 1) / (mu - 1) (T - t_1) + t_1), ratio t_n / T
        expect = torch.floor((n - 1) / (mu - 1) * (T - t1) + t1) / T
        assert torch.allclose(r[n - 1], expect.clamp(1 / T, 1.0), rtol=0, atol=1e-12)  # float64, same formula
    assert (r[1:] >= r[:-1]).all() and torch.equal(r[-1], torch.ones(64, dtype=torch.float64))
    assert r[0].std() > 0.2  # the start is random per sample (uniform on [0, 1): std ~0.29)
    assert torch.equal(unigrpo_ratios(seeds, 2, mu, T), r[1])  # a pure function of (seed, n)
    with pytest.raises(ValueError, match="outside"):
        unigrpo_ratios(seeds, 6, mu, T)


# ---------------------------------------------------------------------------------- advantages
def masked_advantages(rewards, group_ids, scale, eps, clip, baseline=None):
    """The masked trainer's advantages: difrl.algos.group_normalize with its scale and baseline."""
    return group_normalize(rewards, group_ids, "group", eps, clip, scale, baseline)


def test_source_normalisation_leaves_the_on_policy_advantages_unchanged():
    gen = torch.Generator().manual_seed(0)
    reward = torch.rand(12, generator=gen)
    group = torch.arange(12) // 4
    ext = torch.arange(12) % 4 == 3  # one external sample per group of 4
    for scale in ("std", "mean", "loo"):
        mixed, _ = masked_advantages(reward, group, scale, 1e-5, 5.0, baseline=~ext)
        alone, _ = masked_advantages(reward[~ext], group[~ext], scale, 1e-5, 5.0)
        assert torch.allclose(mixed[~ext], alone, atol=1e-6)  # fp32 group stats over another batch layout: reordered
        on_mean = reward[~ext].view(3, 3).double().mean(1)
        if scale != "std":  # an external sample: its reward against the group's on-policy mean
            assert torch.allclose(mixed[ext].double(), reward[ext].double() - on_mean, atol=1e-6)  # fp32 against fp64
    joint, _ = masked_advantages(reward, group, "std", 1e-5, 5.0)
    assert not torch.allclose(joint[~ext], masked_advantages(reward[~ext], group[~ext], "std", 1e-5, 5.0)[0],
                              **FP32_REORDER)  # they differ by O(0.1), far beyond rounding
    # the old estimators' advantages: (r - mean) / (std + eps), r - mean, leave-one-out
    r = torch.tensor([1.0, 0.0, 0.5, 0.5])
    g = torch.zeros(4, dtype=torch.long)
    c = r - r.mean()
    assert torch.allclose(masked_advantages(r, g, "std", 1e-5, 5.0)[0], c / (c.pow(2).mean().sqrt() + 1e-5),
                          **FP32_REORDER)  # the formula in another op order
    loo = torch.stack([r[i] - (r.sum() - r[i]) / 3 for i in range(4)])
    assert torch.allclose(masked_advantages(r, g, "loo", 1e-5, 5.0)[0], loo, **FP32_REORDER)
    assert masked_advantages(torch.ones(4), g, "std", 1e-5, 5.0)[1].all()  # zero spread


# ---------------------------------------------------------------------------------- external rollouts (ERILS)
def test_solver_rollouts_are_valid_and_their_log_probs_exact():
    puzzles, _ = sudoku.test_puzzles(12, 32)
    tokens, prompt = sudoku.encode(puzzles)
    out = sudoku.solver_sample(tokens, seeds=4)
    assert sudoku.solved(sudoku.decode(out.tokens), puzzles).all()
    assert torch.equal(out.tokens[prompt], tokens[prompt]) and torch.equal(out.gen_mask, ~prompt)
    assert torch.equal(sudoku.solver_sample(tokens, seeds=4).tokens, out.tokens)  # same seed, same rollout
    grids = sudoku.solutions()
    for b in range(4):  # by brute force: each token's probability is 1 / (digits some completion allows there)
        order = out.step[b].masked_fill(prompt[b], -1).argsort()
        x = torch.where(prompt[b], puzzles[b], torch.zeros_like(puzzles[b]))
        for cell in order[prompt[b].sum():].tolist():
            fits = ((grids == x) | (x == 0)).all(1)
            allowed = grids[fits, cell].unique().numel()
            # fp32 log(1/k) computed two ways (log-softmax over k equal logits against log k): ulp(2.2) ~ 2.4e-7
            assert abs(out.logp[b, cell].item() + float(torch.log(torch.tensor(float(allowed))))) < 1e-6
            x[cell] = out.tokens[b, cell] + 1


def test_trace_logp_reproduces_the_samplers_policy_log_probs():
    policy = sudoku.load_base()
    puzzles, _ = sudoku.test_puzzles(8, 16)
    tokens, prompt = sudoku.encode(puzzles)
    for steps in (16, 4):  # one token per step, and several per step
        out = llada_sample(policy, tokens, {"prompt_mask": prompt}, steps=steps, temperature=1.0, seeds=9)
        lp = trace_logp(policy, out.tokens, out.gen_mask, out.step, {"prompt_mask": prompt})
        # fp32: the sampler's per-step forwards against one forward over the trace; log-probs to ~ -20, a few ulp
        assert torch.allclose(lp[out.gen_mask], out.policy_logp[out.gen_mask], atol=1e-5)
        assert (lp[~out.gen_mask] == 0).all()


def test_external_solver_rollouts_train_with_is_weights(tmp_path):
    _, d = run(tmp_path / "r", "train.iterations=2", "external.source=solver", "external.per_group=1")
    rows = metrics(d)
    for row in rows:
        assert row["first_step_max_abs_log_ratio"] <= MASKED_FIRST_STEP_LOG_RATIO  # micro-batch vs rollout batch
        assert row["external/reward_mean"] == 1.0  # the solver always solves
        assert 0.0 < row["external/max_weight"] <= 2.0  # TIS, cap 2
        assert row["external/adv_mean"] >= 0.0  # a solution is never worse than the on-policy mean
        assert row["reward_mean"] < 1.0  # the on-policy reward is logged apart from the solver's


def test_external_checkpoint_equal_to_the_policy_has_unit_weights(tmp_path):
    # the same checkpoint at the same temperature as the rollouts: mu_ext == pi_old in every decode context
    _, d = run(tmp_path / "r", "external.source=checkpoint", f"external.path={sudoku.BUNDLED_BASE}",
               "external.correct.method=token_tis")
    row = metrics(d)[0]
    # 0 in exact arithmetic; the checkpoint's log-probs are recomputed in other batch shapes than the rollout's (fp32
    # reordering, a few ulp of log-probs to ~ -20), and max_weight is the worst of all tokens' exp(log ratio)
    assert abs(row["external/max_weight"] - 1.0) < 1e-4 and abs(row["external/mean_log_ratio"]) < 1e-5
    with pytest.raises(ConfigError, match="external.path"):
        load_masked_config(None, [*TINY, "external.source=checkpoint"])
    with pytest.raises(ConfigError, match="external.per_group"):
        load_masked_config(None, [*TINY, "external.source=solver", "external.per_group=4"])


# ---------------------------------------------------------------------------------- accumulation
def test_accumulation_1x8_equals_8x1(tmp_path):
    # one optimizer update per iteration over the same 8 rollouts: its gradient (norm before clipping) and
    # loss must not depend on how the update is cut into micro-batches
    common = ("rollout.prompts_per_iter=2", "rollout.group_size=4", "train.inner_updates=1", "train.kl_beta=0.05")
    for i, est in enumerate((("estimator.kind=maskgrpo",), ("estimator.kind=coupled",), ("external.source=solver",))):
        a = metrics(run(tmp_path / f"a{i}", *common, *est, "train.micro_batch=8", "train.grad_accum=1")[1])[0]
        b = metrics(run(tmp_path / f"b{i}", *common, *est, "train.micro_batch=1", "train.grad_accum=8")[1])[0]
        assert a["grad_norm"] > 0
        # fp32 sums of 8 per-sample terms in two orders (FP32_REORDER's reason); losses O(0.1), kl O(0.01)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"], est
        assert abs(a["policy_loss"] - b["policy_loss"]) < 1e-6 and abs(a["kl"] - b["kl"]) < 1e-7


# ---------------------------------------------------------------------------------- the one reward seam
def cells_nan_for_puzzle_0():
    """A `module:function` reward factory for the masked worlds: sudoku_cells, NaN for every sample of the
    first training puzzle of an iteration (its prompt text is the puzzle) and a second named score."""
    from difrl.rewards.sudoku_cells import sudoku_reward

    def fn(filled, prompts, metadata):
        puzzles = torch.stack([m["puzzle"] for m in metadata])
        r = sudoku_reward(filled, puzzles)
        r[[i for i, p in enumerate(prompts) if p == prompts[0]]] = float("nan")
        return {"cells_nan_for_puzzle_0": r, "blanks": (puzzles == 0).sum(1).float()}

    return fn


def test_masked_world_scores_through_the_registry_with_drop_group(tmp_path):
    name = f"{__name__}:cells_nan_for_puzzle_0"
    _, d = run(tmp_path / "r", "train.iterations=2", f"reward.weights={{'{name}': 1.0}}", "reward.on_error=drop_group",
               "reward.max_failed_frac=0.5")
    rows = metrics(d)
    for r in rows:  # 2 puzzles x 4 rollouts: the first puzzle's group fails and is dropped, the other one trains
        assert r["failed_reward_groups"] == 1 and r["trained_samples"] <= 4
        assert r["reward/cells_nan_for_puzzle_0/blanks"] >= 4  # extra named scores are logged per reward
        assert r["reward_mean"] == r["reward_mean"]  # finite: failed samples are not a score
    # on_error=stop (the default): a checkpoint, then an error naming the reward, the failing samples and resume
    from difrl.rewards import RewardError

    with pytest.raises(RewardError, match=r"iteration 1: non-finite reward.*cells_nan_for_puzzle_0.*resume="):
        run(tmp_path / "s", f"reward.weights={{'{name}': 1.0}}")
    assert (tmp_path / "s" / "checkpoints" / "iter-000000").is_dir()


def test_masked_reward_weights_combine_and_default_to_the_worlds_reward(tmp_path):
    # the world's own reward (reward.weights=null) equals naming it; a second reward with weight 0 changes nothing
    _, a = run(tmp_path / "a", "train.iterations=2")
    _, b = run(tmp_path / "b", "train.iterations=2", "reward.weights={sudoku_cells: 1.0}")
    _, c = run(tmp_path / "c", "train.iterations=2", "reward.weights={sudoku_cells: 1.0, brightness: 0.0}")
    ra, rb, rc = metrics(a), metrics(b), metrics(c)
    assert ra == rb
    assert [r["policy_loss"] for r in rc] == [r["policy_loss"] for r in ra] and "reward/brightness" in rc[0]
    assert all(r["reward/sudoku_cells/solved"] <= r["reward/sudoku_cells"] for r in ra)


def test_masked_reward_errors_name_prompt_ids_not_group_ids(tmp_path):
    # iteration 0's groups are 0 and 1 (it * P + k // G); the failing samples' prompt id is the index of their
    # puzzle's source solution grid (the world's prompt table), which the error must name
    import re

    from difrl.rewards import RewardError
    from difrl.utils.rng import mix_seed

    name = f"{__name__}:cells_nan_for_puzzle_0"
    with pytest.raises(RewardError) as e:
        run(tmp_path / "s", f"reward.weights={{'{name}': 1.0}}")
    _, grids = sudoku.sample_training_puzzles(2, (4, 10), seed=mix_seed(3, 0, 1))  # TINY: seed 3, 2 puzzles
    first = int((sudoku.solutions() == grids[0]).all(1).nonzero())
    named = re.search(r"iteration 1: .*prompt ids \[([\d, ]*)\]", str(e.value))
    assert named and [int(x) for x in named.group(1).split(",")] == [first], (first, str(e.value))
    assert first not in (0, 1)  # the group ids the message named before


def test_every_masked_world_gives_its_prompts_ids():
    from difrl.worlds import build_masked_world
    from difrl.worlds.text_tasks import bundled_problems, load_problems

    for kind in ("sudoku", "digit_tokens", "hf_masked"):
        cfg = load_masked_config(None, [f"model.kind={kind}", "eval.count=4"])
        batch = build_masked_world(cfg).prompts(3, 5).repeat(2)
        assert batch.ids is not None and batch.ids.shape == (6,), kind
        if kind == "sudoku":
            grids = sudoku.solutions()[batch.ids]  # the puzzle's givens are its source grid's digits
            assert all(((p == 0) | (p == g)).all() for p, g in zip((m["puzzle"] for m in batch.metadata), grids))
        elif kind == "digit_tokens":
            assert batch.ids.tolist() == [m["digit"] for m in batch.metadata]
        else:
            train = load_problems(bundled_problems(cfg.model.task, "train"), cfg.model.task)
            assert [train[i]["question"] for i in batch.ids.tolist()] == [m["question"] for m in batch.metadata]
        sub = batch.select(torch.tensor([5, 0]))
        assert sub.ids.tolist() == [int(batch.ids[5]), int(batch.ids[0])]

"""Sol-RL (candidate pool -> selection -> full-precision regeneration), DiffusionNFT and the rollout copy in the
flow trainer, on tiny runs of the digits world.

    .venv/bin/python -m pytest tests/test_solrl.py -q
"""

from __future__ import annotations

import json

import pytest
import torch

import difrl.solrl as solrl
import difrl.train.flow.trainer as flow
from difrl.algos.nft import nft_loss, nft_noised, velocity_kl
from difrl.config import ConfigError
from difrl.models.digits import DigitsPolicy
from difrl.quant import QuantLinear, WeightSyncError, dequantize, merged_state_dict, quantize, quantized_layers
from difrl.rollout import regenerate
from difrl.samplers import sigma_schedule
from difrl.solrl import kendall, rank_agreement, select_indices, spearman
from difrl.train.config import load_flow_config
from difrl.train.flow.trainer import TIMING_KEYS, train
from tolerances import FLOW_FIRST_STEP_LOG_RATIO, FP32_REORDER

TINY = ["seed=3", "sampler.num_steps=4", "rollout.prompts_per_iter=2", "rollout.group_size=4", "train.micro_batch=6",
        "train.grad_accum=2", "train.iterations=2", "eval.every=0", "eval.per_digit=3", "eval.num_steps=3"]
SOLRL = ["rollout.kind=solrl", "rollout.precision=nvfp4", "solrl.candidates=8", "solrl.preview_steps=3"]
NFT = ["train.objective=nft", "nft.ref_beta=0.1", "train.micro_batch=4"]  # 2 samples x 2 trained sigmas


def rows(run_dir):
    return [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------- selection and agreement


def test_selection_rules_against_hand_values():
    r = torch.tensor([[0.5, 1.0, 0.0, 0.75, 0.25, 0.5]])  # exact in binary: mean 0.5
    assert select_indices(r, 4, "best_worst").tolist() == [[1, 2, 3, 4]]  # top 1.0, 0.75; bottom 0.0, 0.25
    assert select_indices(r, 3, "best_worst").tolist() == [[1, 2, 3]]  # ceil(3/2) = 2 best, 1 worst
    # |dev| = 0 .5 .5 .25 .25 0 -> the 3 largest: 1.0, 0.0 and the first of the tied 0.25s (stable)
    assert select_indices(r, 3, "mean_deviation").tolist() == [[1, 2, 3]]
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        ext = select_indices(r, 4, "extremes_random", g)[0].tolist()
        assert 1 in ext and 2 in ext and len(set(ext)) == 4
        rnd = select_indices(r, 4, "random", g)[0].tolist()
        assert len(set(rnd)) == 4 and all(0 <= i < 6 for i in rnd)
    with pytest.raises(ValueError, match="cannot select 7 of 6"):
        select_indices(r, 7)


def test_rank_correlations_match_scipy():
    stats = pytest.importorskip("scipy.stats")
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        a = torch.randint(0, 5, (12,), generator=g).float()  # ties on purpose
        b = a + torch.randn(12, generator=g)
        assert spearman(a, b) == pytest.approx(stats.spearmanr(a, b).statistic, abs=1e-12)  # float64 vs scipy's
        assert kendall(a, b) == pytest.approx(stats.kendalltau(a, b).statistic, abs=1e-12)  # tau-b
    x = torch.arange(6.0)
    assert spearman(x, x) == 1.0 and spearman(x, -x) == -1.0 and kendall(x, -x) == -1.0  # integer ranks: exact
    agg = rank_agreement(torch.stack([x, x, torch.ones(6)]), torch.stack([x, -x, x]))
    assert agg["spearman_median"] == 0.0 and agg["spearman_mean"] == 0.0  # the constant prompt is left out


# ------------------------------------------------------------------------- DiffusionNFT


def test_nft_loss_against_hand_values_and_gradient_only_through_v():
    x0 = torch.tensor([[1.0, -1.0]])
    eps = torch.tensor([[0.5, 0.5]])
    sigma = torch.tensor([0.5])
    x_sigma = nft_noised(x0, sigma, eps)  # (1 - .5) x0 + .5 eps = [0.75, -0.25]
    assert torch.allclose(x_sigma, torch.tensor([[0.75, -0.25]]), **FP32_REORDER)
    v = torch.tensor([[0.0, 2.0]], requires_grad=True)
    v_old = torch.tensor([[-1.0, 1.0]])
    adv = torch.tensor([2.5])  # r = 2.5 / 10 + 0.5 = 0.75
    loss, m = nft_loss(v, v_old, x_sigma, x0, sigma, adv, beta=1.0, adv_clip=5.0)
    # v_pos = v = [0, 2]: x0_pos = x_sigma - .5 v = [0.75, -1.25], err [-0.25, -0.25]: L+ = 0.0625 / 0.25 = 0.25
    # v_neg = 2 v_old - v = [-2, 0]: x0_neg = [1.75, -0.25], err [0.75, 0.75]: L- = 0.5625 / 0.75 = 0.75
    # fp32 on dyadic inputs against float64 hand values: rounding only, a few ulp at most
    assert m["nft_r"].item() == pytest.approx(0.75, rel=1e-6)
    assert m["nft_loss_pos"].item() == pytest.approx(0.25, rel=1e-6)
    assert m["nft_loss_neg"].item() == pytest.approx(0.75, rel=1e-6)
    assert loss.item() == pytest.approx(5.0 * (0.75 * 0.25 + 0.25 * 0.75), rel=1e-6)
    loss.sum().backward()
    assert v.grad is not None and v.grad.abs().sum() > 0 and not v_old.requires_grad
    assert velocity_kl(torch.ones(1, 4), torch.zeros(1, 4)).item() == 1.0


# ------------------------------------------------------------------------- the trainer


def test_solrl_runs_logs_agreement_and_trains_the_regenerated_seeds(tmp_path, monkeypatch):
    calls = []
    real = flow.rollout

    def spy(policy, prompts, seeds, sigmas, kernel="flow_sde", *args, **kwargs):
        out = real(policy, prompts, seeds, sigmas, kernel, *args, **kwargs)
        calls.append({"kernel": kernel, "seeds": out.seeds.clone(), "steps": len(sigmas) - 1, "batch": out,
                      "weights": {k: v.clone() for k, v in policy.module.state_dict().items()},
                      "quantized": bool(quantized_layers(policy.module)), "args": args, "kwargs": kwargs})
        return out

    monkeypatch.setattr(solrl, "rollout", spy)  # stage 1: the candidate pool
    monkeypatch.setattr(flow, "rollout", spy)  # stage 2: the trained rollouts
    train(load_flow_config(None, [*TINY, *SOLRL, "train.lora.enabled=false"]), out_dir=tmp_path)
    cand, regen = calls[0], calls[1]
    # stage 1: 2 prompts x 8 candidates through the NVFP4 copy, 3 deterministic steps
    assert cand["quantized"] and cand["kernel"] == "ode" and cand["steps"] == 3 and len(cand["seeds"]) == 16
    # stage 2: 2 x 4 of those very seeds, full precision, the configured SDE sampler and its 4 steps
    assert not regen["quantized"] and regen["kernel"] == "flow_sde" and regen["steps"] == 4
    assert set(regen["seeds"].tolist()) <= set(cand["seeds"].tolist()) and len(regen["seeds"]) == 8
    # regenerate(seed) with the full-precision policy reproduces what stage 2 trained on, bit for bit
    policy = DigitsPolicy.from_checkpoint()
    policy.module.load_state_dict(regen["weights"])
    policy.module.eval()
    b = regen["batch"]
    again = regenerate(policy, b, sigma_schedule(4), kernel="flow_sde", kernel_kwargs=regen["args"][0],
                       sde_mask=regen["args"][1], train_mask=regen["args"][2])
    # exact: the same rollout (seeds, sigmas, masks, batch) recomputed with the same ops
    assert torch.equal(again.x_final, b.x_final) and torch.equal(again.log_prob_old, b.log_prob_old)
    assert torch.equal(again.x, b.x)
    for r in rows(tmp_path):
        assert r["nfe_lowprec"] == 16 * 3 and r["nfe_full"] == 8 * 4
        assert -1.0 <= r["solrl/spearman_median"] <= 1.0 and -1.0 <= r["solrl/kendall_median"] <= 1.0
        assert set(TIMING_KEYS[-2:]) <= set(r)  # both stage times are logged (their values are never asserted)
        assert r["first_step_max_abs_log_ratio"] <= FLOW_FIRST_STEP_LOG_RATIO  # stage 2 is on-policy


def test_solrl_best_worst_trains_the_extremes_of_the_pool(tmp_path, monkeypatch):
    picked = {}
    real = flow.candidate_pool

    def spy(*args, **kwargs):
        pool = real(*args, **kwargs)
        picked.setdefault("reward", pool.reward)
        return pool

    scores = []
    real_select = solrl.select_indices
    monkeypatch.setattr(solrl, "select_indices", lambda r, k, rule, g: scores.append(r.clone()) or real_select(r, k, rule, g))
    monkeypatch.setattr(flow, "candidate_pool", spy)
    train(load_flow_config(None, [*TINY, *SOLRL, "train.iterations=1"]), out_dir=tmp_path)
    pool = scores[0]  # [2 prompts, 8 candidates]
    chosen = picked["reward"].view(2, 4)
    for p in range(2):
        top2, bottom2 = pool[p].sort(descending=True).values[:2], pool[p].sort().values[:2]
        assert sorted(chosen[p].tolist()) == sorted(top2.tolist() + bottom2.tolist())


def test_nft_objective_trains_and_resumes_exactly(tmp_path):
    extra = [*SOLRL, *NFT, "train.lr=1e-2"]
    train(load_flow_config(None, [*TINY, *extra, "train.iterations=4"]), out_dir=tmp_path / "full")
    train(load_flow_config(None, [*TINY, *extra, "train.iterations=2"]), out_dir=tmp_path / "part")
    train(load_flow_config(None, [*TINY, *extra, "train.iterations=4", f"resume={tmp_path / 'part'}"]))
    strip = lambda rs: [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rs]
    full, part = strip(rows(tmp_path / "full")), strip(rows(tmp_path / "part"))
    assert full == part  # the old policy (an EMA with its own schedule) is in the checkpoint
    for r in full:
        # nft_r: the mean of sampled rewards' weights, near 0.5 for a tiny run (a behaviour band, not rounding)
        assert r["nft_r"] == pytest.approx(0.5, abs=0.2) and r["nft_loss_pos"] > 0 and r["kl"] >= 0
        assert r["solrl/spearman_median"] > 0.5  # deterministic in both stages: the ranking carries over
    assert full[-1]["nft_old_gap"] > 0  # the old policy lags the trained one
    ckpt = tmp_path / "full" / "checkpoints" / "iter-000004"
    assert (ckpt / "old.safetensors").is_file()


def test_rollout_copy_is_synced_after_every_update(tmp_path, monkeypatch):
    seen = []
    real_sync = flow.RolloutCopy.sync

    def spy(self, source, check=True):
        out = real_sync(self, source, check)
        sd = merged_state_dict(source)
        for name, layer in quantized_layers(self.module).items():  # the copy holds quantize(merged current weights)
            assert torch.equal(layer.weight_hat(), dequantize(quantize(sd[name + ".weight"], "nvfp4", "weight"))), name
        seen.append((check, out["changed_layers"], {n: m.weight_hat().clone() for n, m in quantized_layers(self.module).items()}))
        return out

    monkeypatch.setattr(flow.RolloutCopy, "sync", spy)
    train(load_flow_config(None, [*TINY, "rollout.precision=nvfp4", "train.iterations=3", "train.lr=1e-2"]), out_dir=tmp_path)
    # built (unchecked), synced before iteration 1 (unchecked: after a resume this loads the restored weights),
    # then checked before every later rollout, i.e. after every update
    assert [s[0] for s in seen] == [False, False, True, True]
    for (_, _, before), (_, changed, after) in zip(seen[1:], seen[2:]):
        assert changed > 0 and any(not torch.equal(before[n], after[n]) for n in before)


def test_a_sync_that_changes_nothing_stops_the_run(tmp_path, monkeypatch):
    # the silent no-sync bug: the copy keeps its old weights after the policy was updated
    real, unchanged = QuantLinear.update_weight, torch.zeros((), dtype=torch.bool)
    monkeypatch.setattr(QuantLinear, "update_weight", lambda self, w, b=None: real(self, w, b) if not self._keys else unchanged)
    with pytest.raises(WeightSyncError, match="no weight of the nvfp4 rollout copy did"):
        train(load_flow_config(None, [*TINY, "rollout.precision=nvfp4", "train.lora.targets=[fc1,fc2,ada]",
                                     "train.iterations=3", "train.lr=1e-2"]), out_dir=tmp_path)


def test_naive_quant_trains_on_copy_samples_and_logs_low_precision_nfes(tmp_path):
    train(load_flow_config(None, [*TINY, *NFT, "rollout.precision=nvfp4"]), out_dir=tmp_path)
    for r in rows(tmp_path):
        assert r["nfe_lowprec"] == 8 * 4 and r["nfe_full"] == 0  # NFT needs no proximal recompute
        assert "correct/kl_k3" not in r


def test_solrl_and_nft_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="solrl.candidates"):
        load_flow_config(None, ["rollout.kind=solrl", "rollout.group_size=16", "solrl.candidates=8"])
    with pytest.raises(ConfigError, match="rollout.same_init_noise"):
        load_flow_config(None, ["rollout.kind=solrl", "rollout.same_init_noise=true"])
    with pytest.raises(ConfigError, match="correct.method"):
        load_flow_config(None, [*SOLRL, "correct.method=token_tis"])
    with pytest.raises(ConfigError, match="correct.method"):
        load_flow_config(None, ["rollout.precision=nvfp4", "train.objective=nft", "correct.method=seq_mis"])
    with pytest.raises(ConfigError, match="train.objective"):
        load_flow_config(None, ["train.objective=nft", "train.ratio_norm=true"])
    with pytest.raises(ConfigError, match="rollout.precision"):
        load_flow_config(None, ["rollout.precision=fp4"])


def test_a_stale_copy_resumes_exactly_between_syncs(tmp_path):
    # rollouts from a copy refreshed every 2 iterations; resuming at iteration 3 (between syncs) must roll out
    # from the weights of iteration 2's sync, which the checkpoint keeps
    extra = ["rollout.sync_every=2", "correct.method=token_tis", "train.lr=1e-2", "checkpoint_every=3"]
    train(load_flow_config(None, [*TINY, *extra, "train.iterations=5"]), out_dir=tmp_path / "full")
    train(load_flow_config(None, [*TINY, *extra, "train.iterations=3"]), out_dir=tmp_path / "part")
    train(load_flow_config(None, [*TINY, *extra, "train.iterations=5", f"resume={tmp_path / 'part'}"]))
    strip = lambda rs: [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rs]
    full, part = strip(rows(tmp_path / "full")), strip(rows(tmp_path / "part"))
    assert full == part
    k3 = [r["correct/kl_k3"] for r in full]
    # fresh at a sync (up to merged-LoRA vs LoRA-forward rounding), stale one iteration later
    assert abs(k3[0]) < 1e-7 and k3[1] > 1e-5 and abs(k3[2]) < 1e-7 and k3[3] > 1e-5
    assert all(r["nfe_lowprec"] == 0 for r in full)  # an fp32 copy is full precision

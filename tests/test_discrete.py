"""Masked-diffusion policies, samplers and the MDLM loss (difrl.discrete).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_discrete.py -q
"""

from __future__ import annotations

import math

import pytest
import torch

from difrl.discrete.losses import forward_mask, mdlm_loss, sample_t
from difrl.discrete.policy import NEG, HFMaskedLM, MaskedNetConfig, MaskedPolicy, MaskedTransformer, TinyMaskedPolicy
from difrl.discrete.samplers import (
    counter_uniform,
    eb_sample,
    eb_select,
    emerge_sample,
    llada_sample,
    mask_schedule,
    restrict,
    row_seeds,
    transfer_plan,
)

torch.set_num_threads(1)
V, MASK, L = 6, 5, 12
# Exact float comparisons here are on tokens, masks, steps, or the same sampler re-run with the same seeds in this
# process. Rates of sampled masks are checked against their probability within ~4 standard deviations of the
# sampling noise (sqrt(p (1 - p) / n) over n seeded draws: deterministic, counter-based). The rest say why inline.
from tolerances import FP32_REORDER  # noqa: E402


@pytest.fixture(scope="module")
def policy() -> TinyMaskedPolicy:
    torch.manual_seed(0)
    net = MaskedTransformer(MaskedNetConfig(vocab_size=V, mask_id=MASK, seq_len=L, dim=32, layers=2, heads=2, mlp_ratio=2))
    with torch.no_grad():  # sharper, position-dependent logits than the near-uniform init
        net.head.weight.mul_(20.0)
    return TinyMaskedPolicy(net.eval())


def start_tokens(batch: int = 4, prompt_len: int = 4, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, MASK, (batch, L), generator=g)
    x[:, prompt_len:] = MASK
    return x


def check_logps(policy, out, temperature: float, cfg_scale: float = 0.0) -> None:
    """Replay each forward pass: the state before step s is the start plus every token committed at
    an earlier step; the recorded log-probs must be the log-softmax of that state's logits."""
    checked = 0
    for s in range(out.nfe):
        state = torch.where((out.step >= 0) & (out.step < s), out.tokens, out.start)
        logits = policy.logits(state)
        if cfg_scale:
            u = policy.logits(state.masked_fill(~out.gen_mask, MASK))
            logits = (1 + cfg_scale) * logits - cfg_scale * u
        logits = restrict(logits, MASK).double()
        sel = out.step == s
        assert sel.any(), f"forward pass {s} committed nothing"
        tok = out.tokens[sel]
        lp1 = torch.log_softmax(logits[sel], -1).gather(-1, tok[:, None])[:, 0]
        lpt = torch.log_softmax(logits[sel] / temperature, -1).gather(-1, tok[:, None])[:, 0] if temperature > 0 else lp1
        # fp32 log-probs to ~ -10 from the sampler's batched steps against a re-computation per row: a few ulp
        torch.testing.assert_close(out.policy_logp[sel].double(), lp1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.logp[sel].double(), lpt, rtol=1e-5, atol=1e-5)
        checked += int(sel.sum())
    assert checked == int(out.gen_mask.sum())
    assert (out.logp[~out.gen_mask] == 0).all() and (out.step[~out.gen_mask] == -1).all()


def check_prompt_kept(out) -> None:
    assert torch.equal(out.tokens[~out.gen_mask], out.start[~out.gen_mask])
    assert (out.tokens != MASK).all() and (out.tokens < MASK).all()


# ----------------------------------------------------------------------------- policy
def test_tiny_policy_protocol_and_subs(policy):
    assert isinstance(policy, MaskedPolicy)
    x = start_tokens()
    logits = policy.logits(x)
    assert logits.shape == (4, L, V) and logits.dtype == torch.float32
    assert (logits[..., MASK] == NEG).all()
    assert torch.equal(policy.prompt_mask(x), x != MASK)
    pm = torch.zeros_like(x, dtype=torch.bool)
    assert torch.equal(policy.prompt_mask(x, {"prompt_mask": pm}), pm)
    with pytest.raises(ValueError, match="token ids must lie in"):
        policy.logits(x + V)


def test_label_conditioned_transformer_needs_label():
    net = MaskedTransformer(MaskedNetConfig(vocab_size=V, mask_id=MASK, seq_len=L, dim=16, layers=1, heads=2, num_labels=3))
    p = TinyMaskedPolicy(net)
    x = start_tokens(2)
    a = p.logits(x, {"label": torch.tensor([0, 1])})
    b = p.logits(x, {"label": torch.tensor([2, 1])})
    # row 1 has the same input and label in both calls: rows are independent, so equal up to fp32 batching
    assert not torch.allclose(a[0], b[0], **FP32_REORDER) and torch.allclose(a[1], b[1], **FP32_REORDER)
    with pytest.raises(ValueError, match="label-conditioned"):
        p.logits(x)


def test_tiny_checkpoint_roundtrip(tmp_path, policy):
    from difrl.utils.io import save_safetensors

    tensors, meta = policy.state_dict_and_meta(steps=1)
    save_safetensors(tensors, tmp_path / "m.safetensors", meta)
    back = TinyMaskedPolicy.from_checkpoint(tmp_path / "m.safetensors")
    x = start_tokens()
    assert torch.equal(back.logits(x), policy.logits(x))  # exact: the same weights saved and loaded, the same ops
    with pytest.raises(FileNotFoundError, match="not found"):
        TinyMaskedPolicy.from_checkpoint(tmp_path / "nope.safetensors")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from transformers import BertConfig, BertForMaskedLM, BertTokenizer

    d = tmp_path_factory.mktemp("tiny_bert")
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "what", "is", "two", "plus", "three", "five"]
    (d / "vocab.txt").write_text("\n".join(words) + "\n")
    BertTokenizer(str(d / "vocab.txt")).save_pretrained(str(d))
    cfg = BertConfig(vocab_size=len(words), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=32)
    torch.manual_seed(0)
    BertForMaskedLM(cfg).save_pretrained(str(d))
    return d


def test_hf_masked_lm_adapter_from_local_dir(hf_dir):
    from transformers import BertForMaskedLM

    p = HFMaskedLM.from_pretrained(hf_dir)
    assert isinstance(p, MaskedPolicy) and p.mask_id == 4 and p.vocab_size == 11
    tokens, cond = p.encode(["what is two plus three", "five"], gen_length=4)
    assert tokens.shape == (2, 9) and (tokens[:, 5:] == 4).all() and cond["prompt_mask"][:, :5].all()
    assert cond["attention_mask"][1].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 1]  # left padding
    logits = p.logits(tokens, cond)
    ref = BertForMaskedLM.from_pretrained(str(hf_dir), local_files_only=True).eval()(
        input_ids=tokens, attention_mask=cond["attention_mask"]).logits
    assert (logits[..., 4] == NEG).all()
    keep = torch.arange(11) != 4
    # the adapter's forward against BertForMaskedLM's own call (the attention path may differ): fp32 reordering
    torch.testing.assert_close(logits[..., keep], ref[..., keep].float(), **FP32_REORDER)
    out = llada_sample(p, tokens, cond, steps=4, block_length=2, temperature=1.0, seeds=3)
    assert out.nfe == 4 and torch.equal(out.tokens[:, :5], tokens[:, :5]) and (out.tokens[:, 5:] != 4).all()
    assert out.committed_per_step().tolist() == [[1, 1, 1, 1]] * 2
    assert len(p.decode(out.tokens, cond)) == 2


def test_hf_adapter_refuses_what_it_should(tmp_path, hf_dir):
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(FileNotFoundError, match="no such directory"):
        HFMaskedLM.from_pretrained(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        HFMaskedLM.from_pretrained(tmp_path / "empty")
    gpt = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=11, n_embd=16, n_layer=1, n_head=2, n_positions=16)).save_pretrained(str(gpt))
    with pytest.raises(ValueError, match="trust_remote_code=True"):  # not a masked LM; no remote code unless asked
        HFMaskedLM.from_pretrained(gpt)


# ----------------------------------------------------------------------------- MDLM loss
def test_mdlm_loss_hand_computed():
    logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]],
                           [[1.0, 1.0, 0.0], [0.0, 0.0, 3.0], [1.0, 0.0, 0.0]]])
    targets = torch.tensor([[0, 2, 1], [1, 2, 0]])
    masked = torch.tensor([[True, True, False], [True, False, False]])
    answer = torch.tensor([[True, True, True], [False, True, True]])
    t = torch.tensor([0.5, 0.25])
    ce00 = -math.log(math.e**2 / (math.e**2 + 2))  # row 0, pos 0: target 0
    ce01 = -math.log(1 / (math.e + 2))  # row 0, pos 1: target 2
    ce10 = -math.log(math.e / (2 * math.e + 1))  # row 1, pos 0: target 1 (masked although not "answer")
    row0 = (ce00 + ce01) / 0.5 / 3
    row1 = ce10 / 0.25 / 2
    # fp32 log-softmax sums against the float64 hand computation: a few ulp of O(1) values
    assert float(mdlm_loss(logits, targets, masked, t, answer)) == pytest.approx((row0 + row1) / 2, rel=1e-6)
    tokens_norm = ((ce00 + ce01) / 0.5 / 3 + ce10 / 0.25 / 3) / 2
    assert float(mdlm_loss(logits, targets, masked, t, normalize="tokens")) == pytest.approx(tokens_norm, rel=1e-6)


def test_sample_t_antithetic_and_forward_mask():
    g = torch.Generator().manual_seed(0)
    t = sample_t(8, g)
    raw = (t - 1e-3) / (1 - 1e-3)
    assert sorted((raw * 8).floor().long().tolist()) == list(range(8))  # one draw per stratum [i/8, (i+1)/8)
    assert float(t.min()) >= 1e-3 and float(t.max()) <= 1.0
    tokens = torch.randint(0, MASK, (400, 32), generator=g)
    answer = torch.zeros_like(tokens, dtype=torch.bool)
    answer[:, 8:] = True
    tt = torch.full((400,), 0.3)
    noisy, masked = forward_mask(tokens, answer, tt, MASK, g)
    assert not masked[:, :8].any() and torch.equal(noisy[:, :8], tokens[:, :8])  # the prompt is never masked
    assert torch.equal(noisy == MASK, masked)
    assert float(masked[:, 8:].float().mean()) == pytest.approx(0.3, abs=0.02)


# ----------------------------------------------------------------------------- samplers
def test_llada_plan_nfe_blocks_and_logps(policy):
    assert transfer_plan(torch.tensor([7, 4, 0]), 3).tolist() == [[3, 2, 2], [2, 1, 1], [0, 0, 0]]
    x = start_tokens()  # 8 generated positions: 2 blocks of 4, 4 steps each -> 1 token per step
    out = llada_sample(policy, x, steps=8, block_length=4, temperature=0.7, seeds=11)
    assert out.nfe == 8 and out.nfe_per_sample.tolist() == [8] * 4
    assert (out.committed_per_step() == 1).all()
    # semi-autoregressive: block 0 (positions 4..7) is finished in steps 0..3, block 1 in steps 4..7
    assert (out.step[:, 4:8] < 4).all() and (out.step[:, 8:] >= 4).all()
    check_logps(policy, out, 0.7)
    check_prompt_kept(out)
    two = llada_sample(policy, x, steps=4, block_length=8, temperature=1.0, seeds=11)  # 2 tokens per step
    assert two.nfe == 4 and (two.committed_per_step() == 2).all()
    check_logps(policy, two, 1.0)
    with pytest.raises(ValueError, match="divisible by the number of blocks"):
        llada_sample(policy, x, steps=3, block_length=4)


def test_llada_commits_highest_confidence_greedy(policy):
    x = start_tokens()
    out = llada_sample(policy, x, steps=8, temperature=0.0, seeds=0)
    check_logps(policy, out, 0.0)
    for s in range(out.nfe):  # the committed token had the highest max-prob among the masked positions
        state = torch.where((out.step >= 0) & (out.step < s), out.tokens, out.start)
        p = torch.softmax(restrict(policy.logits(state), MASK), -1).max(-1)
        conf = torch.where(state == MASK, p.values, torch.full_like(p.values, -1.0))
        assert torch.equal(conf.argmax(1), (out.step == s).float().argmax(1))
        assert torch.equal(out.tokens[out.step == s], p.indices[out.step == s])


def test_llada_cfg_logps(policy):
    x = start_tokens(2)
    out = llada_sample(policy, x, steps=8, temperature=1.0, cfg_scale=1.5, seeds=5)
    check_logps(policy, out, 1.0, cfg_scale=1.5)


def test_eb_select_rule():
    ent = torch.tensor([[0.05, 0.1, 0.3, 0.02, 0.0]])
    cand = torch.tensor([[True, True, True, True, False]])
    # ascending: 0.02, 0.05, 0.1, 0.3 -> sum - max of the prefixes: 0, 0.02, 0.07, 0.17
    assert eb_select(ent, ent, cand, 0.1).tolist() == [[True, True, False, True, False]]
    assert eb_select(ent, ent, cand, 0.0).tolist() == [[False, False, False, True, False]]
    assert eb_select(ent, ent, cand, 0.2).tolist() == [[True, True, True, True, False]]
    zero = torch.tensor([[0.0, 0.0, 0.5, 0.7]])
    assert eb_select(zero, zero, torch.ones(1, 4, dtype=torch.bool), 0.0).tolist() == [[True, True, True, False]]
    none = eb_select(ent, ent, torch.zeros_like(cand), 1.0)
    assert not none.any()


def test_eb_sampler_gamma_nfe_and_logps(policy):
    x = start_tokens()
    one = eb_sample(policy, x, gamma=0.0, temperature=0.8, seeds=2)
    assert one.nfe == 8 and (one.committed_per_step() == 1).all()  # gamma = 0: one token per step
    check_logps(policy, one, 0.8)
    check_prompt_kept(one)
    allin = eb_sample(policy, x, gamma=1e9, temperature=0.8, seeds=2, block_length=4)
    assert allin.nfe == 2 and (allin.committed_per_step() == 4).all()  # everything in the block at once
    check_logps(policy, allin, 0.8)
    mid = eb_sample(policy, x, gamma=0.5, temperature=1.0, seeds=2, order="margin")
    assert 1 <= mid.nfe <= 8 and int(mid.committed_per_step().sum()) == 32
    check_logps(policy, mid, 1.0)
    # the first step of `mid` took exactly the entropy-bounded prefix of its margin order
    logits = restrict(policy.logits(x), MASK).double()
    p = torch.softmax(logits, -1)
    top = p.topk(2, -1).values
    ent = -(p * torch.log_softmax(logits, -1)).sum(-1)
    assert torch.equal(mid.step == 0, eb_select(-(top[..., 0] - top[..., 1]), ent, x == MASK, 0.5))


def test_emerge_schedule_nfe_and_logps(policy):
    k = mask_schedule(12)
    # k_0 and k_steps are set exactly (documented); cos in float64 against math.cos: within an ulp
    assert k[0] == 1.0 and k[-1] == 0.0 and float(k[6]) == pytest.approx(math.cos(math.pi / 4), rel=1e-12)
    assert mask_schedule(4, "linear").tolist() == [1.0, 0.75, 0.5, 0.25, 0.0]
    x = start_tokens()
    out = emerge_sample(policy, x, steps=12, seeds=4)
    assert 1 <= out.nfe <= 12 and int(out.committed_per_step().sum()) == 32
    check_logps(policy, out, 1.0)
    check_prompt_kept(out)
    hot = emerge_sample(policy, x, steps=5, temperature=0.5, schedule="linear", seeds=4)
    check_logps(policy, hot, 0.5)


def test_emerge_unmask_probabilities():
    class Flat:  # logits independent of the input: only the schedule matters
        mask_id, vocab_size = 1, 2

        def logits(self, tokens, cond=None):
            return torch.zeros(*tokens.shape, 2)

    x = torch.ones(2000, 8, dtype=torch.long)
    out = emerge_sample(Flat(), x, steps=4, seeds=0)
    k = mask_schedule(4)
    step = torch.where(out.gen_mask, out.step, -1)
    # MDLM: unmasked by the end of step i with probability 1 - k_{i+1}
    for i in range(4):
        assert float((step <= i).float().mean()) == pytest.approx(float(1 - k[i + 1]), abs=0.015)


def test_same_seed_same_rollout_and_batch_independence(policy):
    x = start_tokens(6)
    for fn, kw in ((llada_sample, dict(steps=8, temperature=1.0)), (eb_sample, dict(gamma=0.3)), (emerge_sample, {})):
        a, b = fn(policy, x, seeds=123, **kw), fn(policy, x, seeds=123, **kw)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.step, b.step) and torch.equal(a.logp, b.logp)
        c = fn(policy, x, seeds=124, **kw)
        assert not torch.equal(a.tokens, c.tokens)
        # a sample depends on its own seed only: row 3 alone (with its seed) reproduces row 3 of the batch
        solo = fn(policy, x[3:4], seeds=a.seeds[3:4], **kw)
        assert torch.equal(solo.tokens[0], a.tokens[3]) and torch.equal(solo.logp[0], a.logp[3])
        # the same commit order (emerge skips forward passes where no row unmasks, so its pass indices
        # depend on the batch; the order of the commits does not)
        order = lambda st: st[:, None] < st[None, :]
        assert torch.equal(order(solo.step[0]), order(a.step[3]))
        if fn is not emerge_sample:
            assert torch.equal(solo.step[0], a.step[3])


def test_counter_uniform_and_row_seeds():
    s = row_seeds(5, 3)
    assert torch.equal(s, row_seeds(5, 3)) and len(set(s.tolist())) == 3
    u = counter_uniform(s, 1, 0, 1000)
    assert u.dtype == torch.float64 and float(u.min()) > 0 and float(u.max()) < 1
    assert float(u.mean()) == pytest.approx(0.5, abs=0.03)
    assert not torch.equal(u, counter_uniform(s, 1, 1, 1000)) and not torch.equal(u, counter_uniform(s, 2, 0, 1000))
    with pytest.raises(ValueError, match="seeds for a batch"):
        row_seeds(torch.tensor([1, 2]), 3)


# ----------------------------------------------------------------------------- RL re-masking schedules (spec section 3)
def test_maskgrpo_ratio_schedule():
    from difrl.discrete.losses import maskgrpo_ratios

    t2t = maskgrpo_ratios(12, 0.6)  # c = 0.6, mu = 12 -> 0.633 ... 0.999
    # float64, the same formula in another op order (0.999 is the clamp's bound: exact)
    assert float(t2t[0]) == pytest.approx(0.6 + 0.4 / 12, rel=1e-12)
    assert float(t2t[-1]) == 0.999 and (t2t.diff() > 0).all()
    t2i = maskgrpo_ratios(6, 0.6)  # mu = 6 -> 0.667 ... 0.999
    assert t2i.tolist() == pytest.approx([0.6 + 0.4 * n / 6 for n in range(1, 6)] + [0.999], rel=1e-12)


def test_ar_fade_masking_probabilities():
    from difrl.discrete.losses import ar_fade_keep_prob, ar_fade_mask, mask_uniforms, uniform_mask

    answer = torch.zeros(1, 5, dtype=torch.bool)
    answer[0, 1:] = True  # N = 4 answer positions after one prompt token
    kappa = ar_fade_keep_prob(answer, 0.7)[0]  # 2 (1 - r) (1 - i / 3) = 0.6, 0.4, 0.2, 0
    assert kappa.tolist() == pytest.approx([0.0, 0.6, 0.4, 0.2, 0.0], rel=1e-12)  # float64, another op order
    assert ar_fade_keep_prob(answer, 0.2)[0].tolist() == pytest.approx([0.0, 1.0, 1.0, 0.5333333333, 0.0],
                                                                       rel=1e-9)  # the literal's 10 digits
    long = torch.ones(1, 2001, dtype=torch.bool)
    for r in (0.6, 0.8, 0.95):  # expected masked fraction r for r >= 0.5 ...
        # N = 2001: O(1/N) off the limit
        assert float(1 - ar_fade_keep_prob(long, r).mean()) == pytest.approx(r, abs=1e-3)
    assert float(1 - ar_fade_keep_prob(long, 0.3).mean()) == pytest.approx(1 / (4 * 0.7), abs=1e-3)  # ... 0.357 below
    # sampled masks: prompt never masked, the last answer position always masked, rates follow kappa
    seeds = torch.arange(4000)
    u = mask_uniforms(seeds, 3, 5)
    big = answer.expand(4000, 5)
    m = ar_fade_mask(big, 0.7, u)
    assert not m[:, 0].any() and m[:, 4].all()
    assert (1 - m.float().mean(0)).tolist() == pytest.approx([1.0, 0.6, 0.4, 0.2, 0.0], abs=0.03)
    assert torch.equal(m, ar_fade_mask(big, 0.7, mask_uniforms(seeds, 3, 5)))  # same seed + iteration -> same mask
    assert not torch.equal(m, ar_fade_mask(big, 0.7, mask_uniforms(seeds, 4, 5)))
    um = uniform_mask(big, 0.8, u)
    assert not um[:, 0].any() and float(um[:, 1:].float().mean()) == pytest.approx(0.8, abs=0.02)


def test_d1_and_coupled_masks():
    from difrl.discrete.losses import coupled_masks, d1_mask, mask_uniforms

    answer = torch.zeros(3000, 10, dtype=torch.bool)
    answer[:, 4:] = True
    u = mask_uniforms(torch.arange(3000), 0, 10)
    d1 = d1_mask(answer, ~answer, u, 0.15)
    assert d1[:, 4:].all() and float(d1[:, :4].float().mean()) == pytest.approx(0.15, abs=0.02)
    full, a, b, w = coupled_masks(answer, 0.3, u)
    assert torch.equal(full, answer) and not (a & b).any() and torch.equal(a | b, answer)  # complementary
    assert not (a | b)[:, :4].any()  # the prompt is never masked
    assert float(a[:, 4:].float().mean()) == pytest.approx(0.3, abs=0.02)
    # exact: both sides are the float64 1 / 0.3 (1 / 0.7) rounded to fp32 once
    assert torch.equal(w[a], torch.full((int(a.sum()),), 1 / 0.3)) and torch.allclose(w[b], torch.tensor(1 / 0.7),
                                                                                       rtol=0, atol=0)

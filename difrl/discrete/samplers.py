"""Masked-diffusion samplers (rollout policies): LLaDA low-confidence remasking, EB-Sampler, MDLM ancestral.

    out = llada_sample(policy, tokens, cond, steps=16, block_length=16, temperature=0.9, seeds=seeds)
    out = eb_sample(policy, tokens, cond, gamma=0.1, temperature=1.0, seeds=7)
    out = emerge_sample(policy, tokens, cond, steps=12, schedule="cosine", seeds=seeds)
    out.tokens, out.logp, out.step, out.nfe         # see DiscreteRollout

`tokens` [B, L] is the rollout's start: the mask id at every position to generate, the prompt
elsewhere (prompt positions are never read for sampling and never changed). Every sampler is a
loop of pure tensor steps on the policy's logits (``*_step`` functions, usable on their own).

Where tensors live: the rollout's record (tokens, log-probs, plans, uniforms) is kept on the host
(``tokens``' device); the [B, L, V] logits stay on the policy's device (``policy.logits``), where
the log-softmax, the categorical draw and the entropies run. Per step only per-position values come
back: the drawn tokens and their two log-probs, and EB's two fp64 ranking keys per candidate, so a
step's host traffic does not grow with the vocabulary (LLaDA: V = 126,464, 0.5 MB of fp32 logits
per position; tests/test_scale_device.py counts the bytes).

Randomness is counter-based: every draw is a pure function of (sample seed, stream, step,
position) through ``difrl.utils.rng.mix_seed_tensor``, so a sample's rollout depends on its own
seed only, not on its batch neighbours or the batch size (docs/architecture.md seam 3). ``seeds`` is a [B]
tensor of per-sample seeds, or one int ``s`` for row seeds ``mix_seed(s, b)``.

Categorical draws use the inverse CDF of the tempered softmax in fp64 (one uniform per position),
which is distributed exactly as LLaDA's Gumbel-max at temperature T; T = 0 is greedy. Every
committed token carries ``logp``, its log-probability under the distribution it was drawn from
(log_softmax(logits / T); for T = 0 the untempered one), and ``policy_logp`` under the untempered
policy (log_softmax(logits)), both from the logits of the forward pass at the step that committed it
(``step``, the forward-pass index). Which positions get committed (confidence ranking, entropy bound,
the emerge schedule) is not part of these log-probs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from difrl.discrete.policy import NEG
from difrl.models.base import Cond, cond_cat
from difrl.utils.rng import mix_seed, mix_seed_tensor

_STREAM_TOKEN, _STREAM_CONF, _STREAM_UNMASK = 1, 2, 3


@dataclass
class DiscreteRollout:
    tokens: torch.Tensor  # [B, L] long: the finished sequences
    start: torch.Tensor  # [B, L] long: the tokens the rollout started from
    gen_mask: torch.Tensor  # [B, L] bool: positions that were generated (masked at the start)
    logp: torch.Tensor  # [B, L] fp32: log-prob of the committed token under the sampling distribution; 0 elsewhere
    policy_logp: torch.Tensor  # [B, L] fp32: log-prob under the untempered policy; 0 elsewhere
    step: torch.Tensor  # [B, L] long: forward-pass index whose logits committed the position; -1 where not generated
    nfe: int  # forward passes of the policy for the batch (a CFG pass over [cond; uncond] counts once)
    nfe_per_sample: torch.Tensor  # [B] long: forward passes until that sample had nothing left to commit
    seeds: torch.Tensor  # [B] int64

    def committed_per_step(self) -> torch.Tensor:
        """[B, nfe] long: how many tokens each forward pass committed, per sample."""
        out = torch.zeros(self.tokens.shape[0], max(self.nfe, 1), dtype=torch.long)
        b, pos = self.gen_mask.nonzero(as_tuple=True)
        out.index_put_((b, self.step[b, pos]), torch.ones_like(b), accumulate=True)
        return out[:, : self.nfe]


# ----------------------------------------------------------------------------- shared pieces
def row_seeds(seeds: int | torch.Tensor, batch: int) -> torch.Tensor:
    """[B] int64 per-sample seeds; an int s gives mix_seed(s, b) for row b."""
    if isinstance(seeds, int):
        return torch.tensor([mix_seed(seeds, b) for b in range(batch)], dtype=torch.int64)
    seeds = torch.as_tensor(seeds, dtype=torch.int64).reshape(-1)
    if seeds.numel() != batch:
        raise ValueError(f"got {seeds.numel()} seeds for a batch of {batch}")
    return seeds


def counter_uniform(seeds: torch.Tensor, stream: int, step: int, length: int) -> torch.Tensor:
    """[B, length] fp64 uniforms in (0, 1), a pure function of (seeds[b], stream, step, position)."""
    h = mix_seed_tensor(seeds.reshape(-1, 1), stream, step, torch.arange(length, dtype=torch.int64).reshape(1, -1))
    return ((h >> 11).double() + 0.5) * 2.0**-52  # h has 63 bits: its top 52 make the mantissa


def restrict(logits: torch.Tensor, mask_id: int, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 copy with the mask logit (and every id not in `allowed` [V] bool) set to NEG."""
    out = logits.float().clone()
    out[..., mask_id] = NEG
    if allowed is not None:
        out[..., ~allowed.to(out.device)] = NEG
    return out


def draw(logits: torch.Tensor, temperature: float, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample from softmax(logits / T) by inverse CDF: logits [K, V], u [K] fp64 in (0, 1) (any device).
    Returns (tokens [K], logp [K] under the sampling distribution, policy_logp [K] at T = 1), fp32 log-probs, on
    the logits' device. fp64 throughout: the CDF's last entries differ from 1 by less than fp32's resolution."""
    u = u.to(logits.device)
    lp1 = torch.log_softmax(logits.double(), dim=-1)
    if temperature <= 0:
        tok = logits.argmax(-1)
        lpt = lp1
    else:
        lpt = torch.log_softmax(logits.double() / temperature, dim=-1)
        cdf = lpt.exp().cumsum(-1)
        cdf = cdf / cdf[:, -1:]
        tok = (cdf < u[:, None]).sum(-1).clamp_max(logits.shape[-1] - 1)
    pick = lambda lp: lp.gather(-1, tok[:, None])[:, 0].float()
    return tok, pick(lpt), pick(lp1)


def draw_at(logits: torch.Tensor, sel: torch.Tensor, temperature: float,
            u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``draw`` at the positions `sel` [B, L] bool (host) of `logits` [B, L, V] (the policy's device) with the
    uniforms `u` [B, L]: the rows are picked on the device by host indices, and only the K drawn tokens and their
    log-probs come back, on `sel`'s device, in row-major order (that of logits[sel])."""
    b, pos = sel.nonzero(as_tuple=True)
    tok, lp, plp = draw(logits[b, pos], temperature, u[b, pos])
    return tok.to(sel.device), lp.to(sel.device), plp.to(sel.device)


def _forward(policy, x: torch.Tensor, cond: Cond | None, cfg_scale: float, prompt: torch.Tensor) -> torch.Tensor:
    """One (batched) forward; with cfg_scale w > 0 the guided logits (1 + w) c - w u, where the
    unconditional input has the prompt positions replaced by the mask token (LLaDA)."""
    if cfg_scale == 0.0:
        return policy.logits(x, cond)
    xu = x.masked_fill(prompt, policy.mask_id)
    both = policy.logits(torch.cat([x, xu]), None if cond is None else cond_cat([cond, cond]))
    c, u = both.chunk(2)
    return (1.0 + cfg_scale) * c - cfg_scale * u


class _Recorder:
    def __init__(self, tokens: torch.Tensor, mask_id: int, seeds, cond: Cond | None, policy):
        self.start = tokens.clone()
        self.x = tokens.clone()
        self.gen = tokens == mask_id
        self.prompt = policy.prompt_mask(tokens, cond) if hasattr(policy, "prompt_mask") else ~self.gen
        if (self.gen & self.prompt).any():
            raise ValueError("a prompt position holds the mask token: the prompt is never generated")
        self.logp = torch.zeros(tokens.shape, dtype=torch.float32)
        self.plogp = torch.zeros(tokens.shape, dtype=torch.float32)
        self.step = torch.full(tokens.shape, -1, dtype=torch.long)
        self.nfe_row = torch.zeros(tokens.shape[0], dtype=torch.long)
        self.seeds = row_seeds(seeds, tokens.shape[0])
        self.nfe = 0

    def commit(self, sel: torch.Tensor, tok: torch.Tensor, lp: torch.Tensor, plp: torch.Tensor) -> None:
        """sel [B, L] bool (row-major order matches tok / lp / plp [K])."""
        self.x[sel] = tok.to(self.x.dtype)
        self.logp[sel] = lp.to(self.logp.device)
        self.plogp[sel] = plp.to(self.plogp.device)
        self.step[sel] = self.nfe - 1

    def result(self) -> DiscreteRollout:
        return DiscreteRollout(self.x, self.start, self.gen, self.logp, self.plogp, self.step, self.nfe,
                               self.nfe_row, self.seeds)


def _blocks(gen: torch.Tensor, block_length: int | None) -> tuple[torch.Tensor, int]:
    """Block id per position ([L] long; -1 left of the generated region) and the number of blocks.
    Blocks tile [first generated column, L) left to right; the last may be shorter."""
    cols = gen.any(0).nonzero()
    start = int(cols[0]) if len(cols) else gen.shape[1]
    span = gen.shape[1] - start
    bl = span if not block_length else int(block_length)
    if bl <= 0:
        raise ValueError(f"block_length must be positive, got {block_length}")
    ids = torch.full((gen.shape[1],), -1, dtype=torch.long)
    ids[start:] = torch.arange(span) // bl
    return ids, max(1, math.ceil(span / bl))


# ----------------------------------------------------------------------------- LLaDA low-confidence remasking
def transfer_plan(masked_count: torch.Tensor, steps: int) -> torch.Tensor:
    """[B] masked tokens in a block -> [B, steps] tokens to commit per step: floor(m / S) each, one
    more for the first (m mod S) steps (LLaDA's get_num_transfer_tokens)."""
    base = masked_count[:, None] // steps
    extra = (torch.arange(steps)[None, :] < (masked_count[:, None] % steps)).long()
    return base + extra


def llada_step(logits: torch.Tensor, x: torch.Tensor, candidates: torch.Tensor, k: torch.Tensor, *,
               temperature: float, u_token: torch.Tensor, u_conf: torch.Tensor | None = None,
               remasking: str = "low_confidence"):
    """One LLaDA step. logits [B, L, V] (restricted; the policy's device), candidates [B, L] bool (masked, in the
    current block), k [B] how many to commit. Every candidate gets a drawn token; the k with the highest
    confidence (untempered prob of the drawn token; U(0,1) for 'random') are committed.
    Returns (commit [B, L] bool, tokens [K], logp [K], policy_logp [K]) with K = commit.sum(), on x's device
    (the ranking runs there, on the candidates' drawn tokens and log-probs)."""
    tok, lp, plp = draw_at(logits, candidates, temperature, u_token)
    conf = torch.full(x.shape, -math.inf, dtype=torch.float64)
    if remasking == "low_confidence":
        conf[candidates] = plp.double().exp()
    elif remasking == "random":
        conf[candidates] = u_conf[candidates]
    else:
        raise ValueError(f"unknown remasking {remasking!r}; expected 'low_confidence' or 'random'")
    order = torch.sort(conf, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(x.shape[1]).expand_as(order).contiguous())
    commit = candidates & (rank < k[:, None])
    keep = commit[candidates]
    return commit, tok[keep], lp[keep], plp[keep]


@torch.no_grad()
def llada_sample(policy, tokens: torch.Tensor, cond: Cond | None = None, *, steps: int, block_length: int | None = None,
                 temperature: float = 0.0, remasking: str = "low_confidence", cfg_scale: float = 0.0,
                 allowed: torch.Tensor | None = None, seeds: int | torch.Tensor = 0) -> DiscreteRollout:
    """LLaDA semi-autoregressive low-confidence remasking (LLaDA generate.py): the generated region is
    cut into blocks of `block_length` decoded left to right, `steps` / num_blocks steps each; each step
    commits the planned number of highest-confidence drawn tokens of the current block. A step at
    which no sample has anything to commit is skipped (no forward), so nfe = steps whenever every
    block holds at least steps / num_blocks masked tokens."""
    rec = _Recorder(tokens, policy.mask_id, seeds, cond, policy)
    block_id, nblocks = _blocks(rec.gen, block_length)
    if steps % nblocks:
        raise ValueError(f"steps ({steps}) must be divisible by the number of blocks ({nblocks})")
    per_block = steps // nblocks
    s = 0
    for b in range(nblocks):
        in_block = block_id[None, :] == b
        plan = transfer_plan(((rec.x == policy.mask_id) & in_block).sum(1), per_block)
        for i in range(per_block):
            s += 1
            k = plan[:, i]
            if not bool((k > 0).any()):
                continue
            logits = restrict(_forward(policy, rec.x, cond, cfg_scale, rec.prompt), policy.mask_id, allowed)
            rec.nfe += 1
            rec.nfe_row += ((rec.x == policy.mask_id).any(1)).long()
            cand = (rec.x == policy.mask_id) & in_block
            u_conf = counter_uniform(rec.seeds, _STREAM_CONF, s, tokens.shape[1]) if remasking == "random" else None
            commit, tok, lp, plp = llada_step(logits, rec.x, cand, k, temperature=temperature,
                                              u_token=counter_uniform(rec.seeds, _STREAM_TOKEN, s, tokens.shape[1]),
                                              u_conf=u_conf, remasking=remasking)
            rec.commit(commit, tok, lp, plp)
    if (rec.x == policy.mask_id).any():
        raise RuntimeError("llada_sample left masked tokens (a bug: the plan covers every masked token)")
    return rec.result()


# ----------------------------------------------------------------------------- EB-Sampler
def entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy (nats, fp64) of softmax(logits / T) over the last dim (T <= 0: of the untempered softmax)."""
    lp = torch.log_softmax(logits.double() / (temperature if temperature > 0 else 1.0), dim=-1)
    return -(lp.exp() * lp).sum(-1)


def eb_select(err: torch.Tensor, ent: torch.Tensor, candidates: torch.Tensor, gamma: float) -> torch.Tensor:
    """The entropy bound: order candidates by ascending error proxy `err` [B, L], take the largest
    prefix U with sum_U H - max_U H <= gamma (at least one token per row with candidates).
    Returns [B, L] bool."""
    key = torch.where(candidates, err.double(), torch.full_like(err, math.inf, dtype=torch.float64))
    order = torch.sort(key, dim=-1, stable=True).indices
    h = torch.where(candidates, ent.double(), torch.zeros_like(ent, dtype=torch.float64)).gather(1, order)
    c = candidates.gather(1, order)
    bound = h.cumsum(1) - h.cummax(1).values
    take = c & (bound <= gamma)
    take[:, 0] = c[:, 0]  # always at least one
    out = torch.zeros_like(candidates)
    out.scatter_(1, order, take)
    return out


@torch.no_grad()
def eb_sample(policy, tokens: torch.Tensor, cond: Cond | None = None, *, gamma: float = 0.1, temperature: float = 1.0,
              block_length: int | None = None, order: str = "entropy", cfg_scale: float = 0.0,
              allowed: torch.Tensor | None = None, seeds: int | torch.Tensor = 0,
              max_steps: int | None = None) -> DiscreteRollout:
    """EB-Sampler (Ben-Hamu et al. 2025): each forward pass commits, per sample, the largest prefix of
    its masked positions (in the current block, ordered by `order`: 'entropy', 'confidence' = -max
    prob, 'margin' = -(top1 - top2)) whose entropies satisfy sum H - max H <= gamma; each is drawn
    independently from softmax(logits / T). gamma = 0 commits one token per step (more only while
    the earlier ones have exactly zero entropy). Runs until nothing is masked (`max_steps` guards)."""
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    rec = _Recorder(tokens, policy.mask_id, seeds, cond, policy)
    block_id, _ = _blocks(rec.gen, block_length)
    limit = max_steps if max_steps is not None else int(rec.gen.sum(1).max()) if rec.gen.any() else 0
    while (rec.x == policy.mask_id).any():
        if rec.nfe >= limit:
            raise RuntimeError(f"eb_sample did not finish within {limit} forward passes")
        masked = rec.x == policy.mask_id
        # current block per row: the block of its leftmost masked position
        first = torch.where(masked, block_id[None, :].expand_as(masked), torch.full_like(masked, 1 << 30, dtype=torch.long))
        cand = masked & (block_id[None, :] == first.min(1, keepdim=True).values)
        logits = restrict(_forward(policy, rec.x, cond, cfg_scale, rec.prompt), policy.mask_id, allowed)  # device
        rec.nfe += 1
        rec.nfe_row += masked.any(1).long()
        b, pos = cand.nonzero(as_tuple=True)
        lc = logits[b, pos]  # [K, V] the candidates' logits, on the device: the selection reads no other position
        ent_k = entropy(lc, temperature)  # [K] fp64
        if order == "entropy":
            err_k = ent_k
        else:
            p = torch.softmax(lc.double() / (temperature if temperature > 0 else 1.0), dim=-1)
            top = p.topk(2, dim=-1).values
            if order == "confidence":
                err_k = -top[..., 0]
            elif order == "margin":
                err_k = -(top[..., 0] - top[..., 1])
            else:
                raise ValueError(f"unknown order {order!r}; expected 'entropy', 'confidence' or 'margin'")
        # the candidates' two ranking keys are all the selection needs on the host: [B, L] fp64, 0 elsewhere
        ent = torch.zeros(cand.shape, dtype=torch.float64).index_put_((b, pos), ent_k.to(cand.device))
        err = ent if err_k is ent_k else torch.zeros_like(ent).index_put_((b, pos), err_k.to(cand.device))
        sel = eb_select(err, ent, cand, gamma)
        tok, lp, plp = draw_at(logits, sel, temperature, counter_uniform(rec.seeds, _STREAM_TOKEN, rec.nfe, tokens.shape[1]))
        rec.commit(sel, tok, lp, plp)
    return rec.result()


# ----------------------------------------------------------------------------- MDLM ancestral / emerge
def mask_schedule(steps: int, schedule: str = "cosine") -> torch.Tensor:
    """[steps + 1] fp64 masked fraction k_i at tau = i / steps: cos(pi tau / 2) ('cosine', MaskGRPO's
    emerge sampler) or 1 - tau ('linear', MDLM); k_0 = 1 and k_steps = 0 exactly."""
    tau = torch.arange(steps + 1, dtype=torch.float64) / steps
    if schedule == "cosine":
        k = torch.cos(math.pi * tau / 2)
    elif schedule == "linear":
        k = 1.0 - tau
    else:
        raise ValueError(f"unknown schedule {schedule!r}; expected 'cosine' or 'linear'")
    k[0], k[-1] = 1.0, 0.0
    return k


@torch.no_grad()
def emerge_sample(policy, tokens: torch.Tensor, cond: Cond | None = None, *, steps: int = 12, schedule: str = "cosine",
                  temperature: float = 1.0, cfg_scale: float = 0.0, allowed: torch.Tensor | None = None,
                  seeds: int | torch.Tensor = 0) -> DiscreteRollout:
    """MDLM ancestral sampling (== MaskGRPO's emerge sampler): at step i a still-masked position stays
    masked with probability k_{i+1} / k_i, else becomes v ~ softmax(logits / T); the last step unmasks
    everything. Who unmasks does not depend on the logits, so a step where no position unmasks needs
    no forward pass and is skipped (MDLM's caching): nfe <= steps."""
    rec = _Recorder(tokens, policy.mask_id, seeds, cond, policy)
    k = mask_schedule(steps, schedule)
    for i in range(steps):
        masked = rec.x == policy.mask_id
        stay = k[i + 1] / k[i]
        sel = masked & (counter_uniform(rec.seeds, _STREAM_UNMASK, i, tokens.shape[1]) >= stay)
        if not bool(sel.any()):
            continue
        logits = restrict(_forward(policy, rec.x, cond, cfg_scale, rec.prompt), policy.mask_id, allowed)  # device
        rec.nfe += 1
        rec.nfe_row += masked.any(1).long()
        tok, lp, plp = draw_at(logits, sel, temperature, counter_uniform(rec.seeds, _STREAM_TOKEN, i, tokens.shape[1]))
        rec.commit(sel, tok, lp, plp)
    return rec.result()


SAMPLERS = {"llada": llada_sample, "eb": eb_sample, "emerge": emerge_sample}

__all__ = ["DiscreteRollout", "SAMPLERS", "counter_uniform", "draw", "draw_at", "eb_sample", "eb_select", "emerge_sample", "entropy",
           "llada_sample", "llada_step", "mask_schedule", "merge_rollouts", "restrict", "row_seeds", "transfer_plan"]


def merge_rollouts(n: int, parts: list[tuple[torch.Tensor, DiscreteRollout]]) -> DiscreteRollout:
    """One [n]-row rollout from row-disjoint parts (rows index, rollout of those rows); nfe adds up."""
    first = parts[0][1]
    fields = {}
    for name in ("tokens", "start", "gen_mask", "logp", "policy_logp", "step", "nfe_per_sample", "seeds"):
        ref = getattr(first, name)
        out = torch.zeros((n, *ref.shape[1:]), dtype=ref.dtype)
        for rows, part in parts:
            out[rows] = getattr(part, name)
        fields[name] = out
    return DiscreteRollout(nfe=sum(p.nfe for _, p in parts), **fields)

"""The corrector core on the LLM side: a tiny causal LM sampled from an NVFP4 copy, trained in fp32.

    .venv/bin/python scripts/llm_correct_example.py                       # 4 methods x 60 iterations, ~1 min
    .venv/bin/python scripts/llm_correct_example.py --methods none ais --iterations 20

A 2-layer Llama built from a transformers config in code (vocabulary of 16 token ids, no tokenizer
needed) generates 8 tokens after a BOS token; the verifiable reward is the fraction of even token
ids. Rollouts come from `difrl.quant.RolloutCopy`: a copy of the model whose linear layers run in
NVFP4 (W4A4, the exact emulation; `--precision fp8` etc. for the others), re-synced from the trained
model before every rollout, the same class the diffusion trainer uses. So the behaviour policy mu
differs from the trained policy pi; each token's log mu is recorded at sampling time. The update is group-relative REINFORCE, L = -mean_t sg(w_t) A log pi(y_t), where
w comes from `difrl.correct` exactly as the diffusion trainer uses it: a "token" is a token here
and a denoising step there. Only two packages are
imported from difrl: `difrl.correct` and `difrl.quant`, both pure torch.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from difrl.correct import METHODS  # noqa: E402
from difrl.quant import FORMATS, RolloutCopy  # noqa: E402

VOCAB, BOS, LENGTH = 16, 0, 8


def tiny_lm(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


@torch.no_grad()
def sample(model, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, 1 + L] token ids (BOS first) and [B, L] log-probs of the sampled tokens under `model`."""
    ids = torch.full((batch, 1), BOS, dtype=torch.long)
    logps = []
    for _ in range(LENGTH):
        logits = model(input_ids=ids).logits[:, -1].float()
        logp = torch.log_softmax(logits, -1)
        nxt = torch.multinomial(logp.exp(), 1, generator=gen)
        logps.append(logp.gather(1, nxt))
        ids = torch.cat([ids, nxt], 1)
    return ids, torch.cat(logps, 1)


def token_log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    """[B, L] log pi(y_t | y_<t) of the generated tokens, with gradient."""
    logp = torch.log_softmax(model(input_ids=ids[:, :-1]).logits.float(), -1)
    return logp.gather(2, ids[:, 1:, None])[..., 0]


def reward(ids: torch.Tensor) -> torch.Tensor:
    return (ids[:, 1:] % 2 == 0).float().mean(1)  # fraction of even token ids


def run(method: str, iterations: int, groups: int, group_size: int, lr: float, seed: int,
        precision: str = "nvfp4") -> dict:
    model = tiny_lm(seed)
    behaviour = RolloutCopy(model, precision, skip=("lm_head",))  # the output layer stays exact
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed + 1)
    history = []
    for it in range(iterations):
        # ---- rollout: behaviour policy mu = the quantized copy, synced after the last update
        behaviour.sync(model, check=it > 0)
        ids, log_mu = sample(behaviour.module, groups * group_size, gen)
        # ---- reward and group-relative advantage
        r = reward(ids)
        rg = r.view(groups, group_size)
        adv = ((rg - rg.mean(1, keepdim=True)) / (rg.std(1, keepdim=True, unbiased=False) + 1e-4)).view(-1)
        # ---- correction: weights for pi_old / mu (pi_old = the trainer's policy before this update)
        log_pi = token_log_probs(model, ids)
        c = METHODS[method](log_pi, log_mu, torch.ones_like(log_mu, dtype=torch.bool))
        # ---- update: REINFORCE with detached weights (one update per rollout, so pi_theta = pi_old here)
        loss = -(c.weights * adv[:, None] * log_pi).sum() / c.keep.sum().clamp_min(1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append({"iteration": it + 1, "reward": float(r.mean()),
                        **{k: float(v) for k, v in c.diagnostics.items()}})
    final = sum(h["reward"] for h in history[-5:]) / min(5, len(history))
    return {"method": method, "final_reward": final, "first_reward": history[0]["reward"],
            "mean_kl_k3": sum(h["kl_k3"] for h in history) / len(history),
            "mean_masked_frac": sum(h["masked_frac"] for h in history) / len(history), "history": history}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=["none", "token_tis", "seq_mis", "ais"],
                    choices=sorted(METHODS))
    ap.add_argument("--iterations", type=int, default=60)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--precision", default="nvfp4", choices=FORMATS, help="the behaviour copy's format")
    ap.add_argument("--json", help="write the results (with per-iteration histories) here")
    args = ap.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    results = [run(m, args.iterations, args.groups, args.group_size, args.lr, args.seed, args.precision) for m in args.methods]
    print(f"{'method':10s} {'reward first':>12s} {'last 5':>8s} {'mean K3(mu||pi)':>16s} {'masked':>7s}")
    for res in results:
        print(f"{res['method']:10s} {res['first_reward']:12.3f} {res['final_reward']:8.3f} {res['mean_kl_k3']:16.2e} "
              f"{res['mean_masked_frac']:7.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()

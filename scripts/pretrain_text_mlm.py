"""Build the tiny masked LM in code and pretrain it, LLaDA-SFT style, just enough on the bundled
arithmetic problems to be a weak base for RL (difrl/assets/text_mlm_base/).

    python scripts/pretrain_text_mlm.py                        # writes difrl/assets/text_mlm_base/
    python scripts/pretrain_text_mlm.py --out /tmp/mlm --steps 600 --eval-every 100
    python scripts/pretrain_text_mlm.py --write-problems       # also rewrite difrl/assets/text_tasks/*.jsonl

Deterministic (one thread, every draw from a seeded generator). Model: difrl.discrete.tiny_mlm's
BertForMaskedLM (bidirectional attention) over the character tokenizer; layout: the question in the
chat template, left-padded, then the answer and EOS padding to gen_length (difrl.worlds.text_tasks).
Loss: LLaDA's SFT masking (ML-GSAI/LLaDA GUIDELINES.md): per row t ~ U(eps, 1), every answer position masked with
probability t (at least one), the prompt never masked; loss = sum over masked positions of CE,
divided by the answer block's length and the batch. LLaDA's 1/t weight is left out: with it the
loss of this tiny model swung between 1 and 7 from step to step. Stopped early on purpose: the base
must leave RL room (the eval it prints: greedy accuracy and sampled pass@1 on the bundled test set).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from difrl.discrete.policy import HFMaskedLM
from difrl.discrete.tiny_mlm import BUNDLED_DIR, build_char_tokenizer, build_tiny_mlm, save_tiny_mlm
from difrl.utils.rng import mix_seed
from difrl.worlds.text_tasks import (TextLayout, bundled_problems, evaluate_text, load_problems, prompt_width,
                                     write_problems)

TASK, GEN_LENGTH, EPS = "arithmetic", 4, 1e-3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=BUNDLED_DIR)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=0, help="print the eval every this many steps (0 = at the end)")
    ap.add_argument("--write-problems", action="store_true", help="rewrite the bundled problem files first")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    # ======================================================================== setup
    if args.write_problems:
        for p in write_problems():
            print(f"wrote {p}")
    train = load_problems(bundled_problems(TASK, "train"), TASK)
    test = load_problems(bundled_problems(TASK, "test"), TASK)
    tok = build_char_tokenizer()
    model = build_tiny_mlm(tok, seed=args.seed)
    policy = HFMaskedLM(model, tok.mask_token_id, len(tok), tok)
    layout = TextLayout(policy, GEN_LENGTH, prompt_width(policy, train + test))
    batch = layout.prompts(train, TASK)
    x0 = torch.cat([batch.tokens[:, :-GEN_LENGTH], layout.answer_ids(train)], dim=1)  # [N, L] clean sequences
    att = batch.cond["attention_mask"]
    answer = ~batch.prompt  # [N, L] the answer block
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    print(f"tiny MLM: {sum(p.numel() for p in model.parameters())} parameters, vocabulary {len(tok)}, "
          f"layout {x0.shape[1] - GEN_LENGTH} prompt + {GEN_LENGTH} answer tokens, {len(train)} train problems")

    def evaluate(step: int) -> None:
        kw = dict(steps=GEN_LENGTH, block_length=GEN_LENGTH)
        ev = evaluate_text(policy, layout, test, TASK, "llada", kw, n=8, ks=(1, 8), temperature=1.0, seed=1234)
        print(f"step {step}: greedy accuracy {ev['greedy_accuracy']:.3f}, sampled pass@1 {ev['pass@1']:.3f}, "
              f"pass@8 {ev['pass@8']:.3f}, format {ev['format_rate']:.3f}", flush=True)

    # ======================================================================== LLaDA SFT
    gen = torch.Generator().manual_seed(mix_seed(args.seed, 1))
    t0 = time.perf_counter()
    model.train()
    for step in range(1, args.steps + 1):
        rows = torch.randint(0, len(train), (args.batch,), generator=gen)
        x, a = x0[rows], answer[rows]
        t = EPS + (1 - EPS) * torch.rand(args.batch, 1, generator=gen)
        m = (torch.rand(x.shape, generator=gen) < t) & a
        first = a.float().argmax(1)  # at least one masked answer token per row: force one at random
        force = first + torch.randint(0, GEN_LENGTH, (args.batch,), generator=gen)
        m[torch.arange(args.batch), force] = True
        logits = model(input_ids=torch.where(m, tok.mask_token_id, x), attention_mask=att[rows]).logits
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), x, reduction="none")  # [B, L]
        loss = (ce * m).sum() / (GEN_LENGTH * args.batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if args.eval_every and step % args.eval_every == 0 and step < args.steps:
            model.eval()
            print(f"step {step}: loss {loss.item():.3f} ({time.perf_counter() - t0:.0f} s)")
            evaluate(step)
            model.train()
    model.eval()

    # ======================================================================== save
    evaluate(args.steps)
    save_tiny_mlm(model, tok, args.out)
    print(f"saved {args.out} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()

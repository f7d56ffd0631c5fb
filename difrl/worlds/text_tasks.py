"""Text tasks with verifiable rewards for any local transformers masked LM (``model.kind=hf_masked``).

    difrl train configs/text_arithmetic.yaml                       # the bundled tiny MLM on "23+45=" -> "068"
    difrl train configs/text_arithmetic.yaml model.path=/models/LLaDA-8B-Instruct model.trust_remote_code=true \
        model.gen_length=64 sampler.block_length=32 sampler.steps=32

    problems = load_problems(bundled_problems("arithmetic", "train"), "arithmetic")   # list of dicts, checked
    policy = load_text_policy(BUNDLED_DIR)                       # HFMaskedLM (weights, tokenizer, chat template)
    layout = TextLayout(policy, gen_length=4, width=prompt_width(policy, problems))
    batch = layout.prompts(problems[:8], "arithmetic")           # MaskedPrompts: [8, width + 4]
    texts = layout.decode(out.tokens)                            # completions, cut at the first EOS
    metrics = evaluate_text(policy, layout, test_problems, "arithmetic", "llada", kw, n=8, ks=(1, 8), ...)

Problem files are JSONL, one problem per line, with at least ``question`` (the user turn) and
``answer`` (a reference answer, what the SFT script trains on); countdown lines add ``numbers`` and
``target``, sudoku_text lines ``puzzle``. Small sets are bundled in difrl/assets/text_tasks/
(``make_problems`` writes them; ``scripts/pretrain_text_mlm.py --write-problems``):

- arithmetic: "07+45=" -> "052" for a, b in 0..99 (zero-padded), 200 test pairs, the other 9,800
  train; any integer equal to a + b scores ("52" too).
- countdown: "use 3 5 7 to make 22" -> an expression using each number once with + - * (one reference
  answer; any correct expression scores), 100 test / 1,000 train, problems disjoint.
- sudoku_text: "solve 12.4/..3./..../...1" -> "1234/3412/2143/4321", test puzzles cut from the Sudoku
  world's held-out solution grids (8 blanks), train puzzles from its train grids (4..10 blanks).

Layout (LLaDA's): the prompt (the question as one user turn of the tokenizer's chat template, when
it has one) left-padded with [PAD] to a fixed width, attention mask 0 on the padding, then
``gen_length`` mask tokens. Prompt and padding are never masked or generated. The model answers,
then writes EOS; everything after the first EOS is padding and is dropped by ``decode``. Sampling is
LLaDA's semi-autoregressive low-confidence remasking (``sampler.block_length``, ``sampler.steps``)
or any other masked sampler. Rewards: ``text_correct`` and ``text_format`` (difrl/rewards/text_tasks.py).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from difrl.eval.passk import masked_pass_at_k
from difrl.rewards.text_tasks import TEXT_TASKS, extract_answer, is_correct
from difrl.utils.rng import mix_seed
from difrl.worlds.masked import MaskedPrompts, MaskedWorld

ASSETS = Path(__file__).resolve().parent.parent / "assets"
PROBLEM_DIR = ASSETS / "text_tasks"
_FIELDS = {"arithmetic": ("question", "answer"), "countdown": ("question", "answer", "numbers", "target"),
           "sudoku_text": ("question", "answer", "puzzle")}


# ----------------------------------------------------------------------------- problems
def bundled_problems(task: str, split: str) -> Path:
    if task not in TEXT_TASKS:
        raise ValueError(f"unknown text task {task!r}; known: {', '.join(TEXT_TASKS)}")
    return PROBLEM_DIR / f"{task}_{split}.jsonl"


def load_problems(path: str | Path, task: str) -> list[dict]:
    """The problems of a JSONL file (one JSON object per line, blank lines skipped), each checked to hold
    the task's fields; a missing file, bad JSON or a missing field raises naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"problem file not found: {path} (JSONL, one {{'question', 'answer', ...}} per line)")
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            p = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} line {i}: not JSON ({e})") from e
        missing = [f for f in _FIELDS[task] if not isinstance(p, dict) or f not in p]
        if missing:
            raise ValueError(f"{path} line {i}: a {task} problem needs {list(_FIELDS[task])}; missing {missing}")
        out.append(p | {"task": task})
    if not out:
        raise ValueError(f"{path}: no problems")
    return out


def make_problems(task: str, seed: int = 0) -> dict[str, list[dict]]:
    """The bundled sets {"train": [...], "test": [...]} of a task, a pure function of `seed` (train and
    test problems disjoint)."""
    rng = random.Random(mix_seed(seed, TEXT_TASKS.index(task)))
    if task == "arithmetic":
        pairs = [(a, b) for a in range(100) for b in range(100)]
        rng.shuffle(pairs)
        # zero-padded operands and answer: digits of equal weight sit at fixed positions, which a tiny
        # character-level model needs to learn carrying in minutes on a CPU (the verifier compares values)
        make = lambda a, b: {"question": f"{a:02d}+{b:02d}=", "answer": f"{a + b:03d}"}  # noqa: E731
        return {"test": [make(*p) for p in pairs[:200]], "train": [make(*p) for p in pairs[200:]]}
    if task == "countdown":
        seen, probs = set(), []
        while len(probs) < 1100:
            nums = [rng.randint(1, 9) for _ in range(3)]
            ops = [rng.choice("+-*") for _ in range(2)]
            expr = f"{nums[0]}{ops[0]}{nums[1]}{ops[1]}{nums[2]}"
            target = _int_eval(expr)
            key = (tuple(sorted(nums)), target)
            if not 0 <= target <= 99 or key in seen:
                continue
            seen.add(key)
            probs.append({"question": f"use {' '.join(map(str, nums))} to make {target}", "answer": expr,
                          "numbers": nums, "target": target})
        return {"test": probs[:100], "train": probs[100:]}
    from difrl.worlds import sudoku

    def rows(grid) -> str:
        return sudoku.puzzle_text(torch.as_tensor(grid))

    test, test_grids = sudoku.test_puzzles(8, 100, mix_seed(seed, 11))
    train, train_grids = sudoku.sample_training_puzzles(1000, (4, 10), mix_seed(seed, 12))
    make = lambda p, g: {"question": f"solve {rows(p)}", "answer": rows(g), "puzzle": rows(p)}  # noqa: E731
    return {"test": [make(p, g) for p, g in zip(test, test_grids)], "train": [make(p, g) for p, g in zip(train, train_grids)]}


def _int_eval(expr: str) -> int:
    import ast

    from difrl.rewards.text_tasks import _eval_expr

    return _eval_expr(ast.parse(expr, mode="eval").body)


def write_problems(out_dir: str | Path = PROBLEM_DIR, seed: int = 0) -> list[Path]:
    """Write every task's bundled sets as out_dir/{task}_{split}.jsonl."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for task in TEXT_TASKS:
        for split, probs in make_problems(task, seed).items():
            path = out_dir / f"{task}_{split}.jsonl"
            path.write_text("".join(json.dumps(p) + "\n" for p in probs))
            paths.append(path)
    return paths


# ----------------------------------------------------------------------------- policy and layout
def load_text_policy(path: str | Path | None = None, *, base: str | Path | None = None, trust_remote_code: bool = False,
                     dtype: str = "auto", gradient_checkpointing: bool = False, mask_id: int | None = None):
    """An HFMaskedLM from a transformers directory (None: the bundled tiny MLM), or from a trained run's
    policy.safetensors (then `base` is the directory it was trained from). dtype "auto": bf16 on a CUDA
    device that supports it, fp32 otherwise (CPU training stays fp32). Remote code runs only when
    `trust_remote_code` is True."""
    from difrl.discrete.policy import HFMaskedLM
    from difrl.discrete.tiny_mlm import BUNDLED_DIR

    path = Path(path) if path else BUNDLED_DIR
    weights = None
    if path.suffix == ".safetensors":
        weights, path = path, Path(base) if base else BUNDLED_DIR
    device = "cuda" if torch.cuda.is_available() else None
    if dtype == "auto":
        dtype = "bf16" if device == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    policy = HFMaskedLM.from_pretrained(path, mask_id=mask_id, trust_remote_code=trust_remote_code, dtype=dtype,
                                        device=device)
    if weights is not None:
        policy.load_weights(weights)
    if policy.tokenizer is None:
        raise ValueError(f"{path} has no tokenizer: the text tasks need one (tokenizer.json / tokenizer_config.json)")
    if policy.tokenizer.eos_token_id is None:
        raise ValueError(f"{path}: the tokenizer has no EOS token; the text layout ends every answer with EOS")
    if gradient_checkpointing:
        if not getattr(policy.model, "supports_gradient_checkpointing", False):
            raise ValueError(f"{path}: model.gradient_checkpointing=true, but this model does not support it")
        model = policy.model
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x; the old name is deprecated there
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return policy


def prompt_width(policy, problems: list[dict], chat: bool = True) -> int:
    """The prompt region's width: the longest question's token count after the chat template."""
    texts = policy.chat_prompts([p["question"] for p in problems]) if chat else [p["question"] for p in problems]
    return max(len(ids) for ids in policy.tokenizer(texts, add_special_tokens=False)["input_ids"])


class TextLayout:
    """Fixed prompt / answer layout of one task: [pad.. prompt | gen_length masks] (see the module doc)."""

    def __init__(self, policy, gen_length: int, width: int, chat: bool = True):
        self.policy, self.gen_length, self.width, self.chat = policy, int(gen_length), int(width), chat

    def prompts(self, problems: list[dict], task: str, ids: torch.Tensor | None = None):
        """MaskedPrompts of `problems`; `ids` [n]: their lines in the problem file (what a reward error names)."""
        tokens, cond = self.policy.encode([p["question"] for p in problems], self.gen_length, chat=self.chat,
                                          width=self.width)
        return MaskedPrompts(tokens, cond, [p["question"] for p in problems], [dict(p, task=task) for p in problems],
                             ids)

    def decode(self, tokens: torch.Tensor) -> list[str]:
        prompt = torch.zeros(tokens.shape, dtype=torch.bool)
        prompt[:, : tokens.shape[1] - self.gen_length] = True
        return self.policy.decode(tokens, {"prompt_mask": prompt})

    def answer_ids(self, problems: list[dict]) -> torch.Tensor:
        """[N, gen_length] reference answers as tokens, then EOS to the end (LLaDA's SFT padding); an answer
        longer than gen_length - 1 raises."""
        tok = self.policy.tokenizer
        rows = []
        for p, ids in zip(problems, tok([str(p["answer"]) for p in problems], add_special_tokens=False)["input_ids"]):
            if len(ids) >= self.gen_length:
                raise ValueError(f"answer {p['answer']!r} needs {len(ids)} tokens + EOS > gen_length {self.gen_length}")
            rows.append(ids + [tok.eos_token_id] * (self.gen_length - len(ids)))
        return torch.tensor(rows, dtype=torch.long)


# ----------------------------------------------------------------------------- evaluation
def evaluate_text(policy, layout: TextLayout, problems: list[dict], task: str, sampler: str, sampler_kwargs: dict, *,
                  n: int, ks, temperature: float, seed: int) -> dict:
    """pass@k (unbiased, difrl.eval.passk) of `policy` on `problems` with the training sampler at `temperature`,
    plus greedy accuracy (temperature 0, one sample), the format rate of the sampled completions and the
    mean forward passes. Keys: "pass@k" for k in ks, "greedy_accuracy", "format_rate", "nfe", "n", "problems"."""
    from types import SimpleNamespace

    world = SimpleNamespace(name="hf_masked", decode=layout.decode)  # what masked_pass_at_k reads of a world
    batch = layout.prompts(problems, task)
    fmt: list[float] = []

    def correct(texts: list[str], b) -> torch.Tensor:
        fmt.extend(float(extract_answer(task, t) is not None) for t in texts)
        return torch.tensor([is_correct(task, t, m) for t, m in zip(texts, b.metadata)])

    net = policy.module
    was_training = net.training
    net.eval()
    try:
        res = masked_pass_at_k(world, policy, sampler, sampler_kwargs, n=n, ks=ks, temperature=temperature, seed=seed,
                               correct_fn=correct, prompts=batch, per_problem=False)
        sampled_format = sum(fmt) / max(len(fmt), 1)
        greedy = masked_pass_at_k(world, policy, sampler, sampler_kwargs, n=1, ks=[1], temperature=0.0, seed=seed,
                                  correct_fn=correct, prompts=batch, per_problem=False)
    finally:
        net.train(was_training)
    out = {f"pass@{k}": res[f"pass@{k}"] for k in ks}
    return out | {"greedy_accuracy": greedy["pass@1"], "format_rate": sampled_format, "nfe": res["nfe"],
                  "n": res["n"], "problems": res["problems"]}


# ----------------------------------------------------------------------------- the world
def masked_world(cfg, policy=None) -> MaskedWorld:
    """The MaskedWorld of model.kind=hf_masked: cfg.model.{path, task, problems, gen_length, ...}; `policy`: this one
    instead of model.path's (difrl plan: an architecture built on fake tensors)."""
    m = cfg.model
    train = load_problems(m.problems or bundled_problems(m.task, "train"), m.task)
    test = load_problems(cfg.eval.problems or bundled_problems(m.task, "test"), m.task)[: cfg.eval.count]

    def load_policy(path=None):
        return load_text_policy(path or m.path, base=m.path, trust_remote_code=m.trust_remote_code, dtype=m.dtype,
                                gradient_checkpointing=m.gradient_checkpointing, mask_id=m.mask_id)

    policy = load_policy(None) if policy is None else policy
    layout = TextLayout(policy, m.gen_length, prompt_width(policy, train + test, m.chat_template), m.chat_template)
    layout.answer_ids(train + test)  # an answer that cannot fit gen_length stops here, not mid-run

    def prompts(n: int, seed: int):
        gen = torch.Generator().manual_seed(mix_seed(seed, 21))
        ids = torch.randint(0, len(train), (n,), generator=gen)
        return layout.prompts([train[i] for i in ids.tolist()], m.task, ids)

    def evaluate(pol) -> dict:
        return evaluate_text(pol, layout, test, m.task, cfg.sampler.kind, cfg.sampler.sampler_kwargs(), n=cfg.eval.samples,
                             ks=cfg.eval.pass_k, temperature=cfg.sampler.temperature, seed=cfg.eval.seed)

    world = MaskedWorld("hf_masked", policy, prompts, layout.decode, "text_correct", evaluate,
                        tuple(f"pass@{k}" for k in cfg.eval.pass_k) + ("greedy_accuracy",), load_policy)
    world.layout = layout  # for scripts and benchmarks: the task's prompt / answer layout
    return world


# the config keys only this world reads (the fields are in difrl/train/masked/config.py, where a saved config.yaml
# of any masked world lists them); another masked world refuses them when set
OWN_KEYS = {"model": ("task", "problems", "gen_length", "chat_template", "trust_remote_code", "dtype",
                      "gradient_checkpointing", "mask_id"),
            "eval": ("problems", "samples", "pass_k")}


def check_config(cfg) -> None:
    """What this world refuses of a MaskedConfig: LLaDA blocks that do not tile the answer block."""
    from difrl.config import config_error

    bl, gl = cfg.sampler.block_length, cfg.model.gen_length
    if bl is not None and gl % bl:
        raise config_error("sampler.block_length", f"{bl} does not divide model.gen_length={gl} (LLaDA's blocks tile "
                                                   "the answer)")
    if cfg.sampler.kind == "llada" and cfg.sampler.steps % (gl // (bl or gl)):
        raise config_error("sampler.steps", f"{cfg.sampler.steps} is not divisible by the number of blocks "
                                            f"{gl // (bl or gl)} (model.gen_length / sampler.block_length)")


__all__ = ["OWN_KEYS", "PROBLEM_DIR", "TextLayout", "bundled_problems", "check_config", "evaluate_text",
           "load_problems", "load_text_policy", "make_problems", "masked_world", "prompt_width",
           "write_problems"]

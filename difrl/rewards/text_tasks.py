"""Verifiable rewards for the text tasks of the ``hf_masked`` world: answer extraction, correctness, format.

    fn = build_reward("text_correct")        # 1 when the extracted answer is right for the sample's problem
    fn = build_reward("text_format")         # 1 when the completion is a well-formed answer of its task
    fn(["19", "1 9", ""], prompts, [{"task": "arithmetic", "answer": "19"}] * 3)
    # {"text_correct": tensor([1., 0., 0.])} / {"text_format": tensor([1., 0., 0.])}
    extract_answer("countdown", " 3*5+7 ")   # "3*5+7"; None when the completion is not well formed

Samples are the completions as text, already cut at the first EOS by the world's decode (the tokens
after EOS are padding, as in LLaDA's generations). Each sample's metadata names its ``task`` and
carries what the verifier needs (``answer``; countdown: ``numbers``, ``target``; sudoku_text:
``puzzle``). Tasks and their answer formats (the completion, surrounding whitespace stripped):

- ``arithmetic`` ("23+45=" -> "68"): an integer, optionally signed; correct = equal to ``answer``.
- ``countdown`` ("use 3 5 7 to make 22" -> "3*5+7"): an expression of integers, + - * and
  parentheses; correct = it uses exactly the given numbers (as a multiset) and evaluates to
  ``target``. Evaluation walks the Python AST of the expression (no ``eval``).
- ``sudoku_text`` ("solve 12.4/..3./..../...1" -> "1234/3412/2143/4321"): four rows of four digits
  1..4 separated by "/"; correct = the grid keeps the puzzle's givens and is a valid 4x4 Sudoku
  (the Sudoku world's verifier, difrl/rewards/sudoku_cells.py).

The format reward is the "well formed" half of d1's XML-format rewards for a model without tags:
it pays for an answer that parses, whatever its value.
"""

from __future__ import annotations

import ast
import re
from collections import Counter

import torch

from difrl.rewards import register_reward

TEXT_TASKS = ("arithmetic", "countdown", "sudoku_text")
_INT = re.compile(r"[+-]?\d+")
_EXPR = re.compile(r"[0-9+\-*() ]+")
_GRID = re.compile(r"[1-4]{4}(/[1-4]{4}){3}")


def extract_answer(task: str, text: str) -> str | None:
    """The answer in a completion `text` (cut at EOS), normalised, or None when it is not well formed."""
    s = text.strip()
    if task == "arithmetic":
        return str(int(s)) if _INT.fullmatch(s) else None
    if task == "countdown":
        if not _EXPR.fullmatch(s) or not any(c.isdigit() for c in s):
            return None
        try:
            _eval_expr(ast.parse(s, mode="eval").body)
        except (SyntaxError, ValueError):
            return None
        return s.replace(" ", "")
    if task == "sudoku_text":
        return s if _GRID.fullmatch(s) else None
    raise ValueError(f"unknown text task {task!r}; known: {', '.join(TEXT_TASKS)}")


def _eval_expr(node) -> int:
    """Integer value of an AST of integers, unary -, and binary + - * (anything else: ValueError)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval_expr(node.operand)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
        a, b = _eval_expr(node.left), _eval_expr(node.right)
        return a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) else a * b
    raise ValueError(f"not an integer + - * expression: {ast.dump(node)[:60]}")


def _numbers_used(node) -> list[int]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant)]


def is_correct(task: str, text: str, meta: dict) -> bool:
    """Whether completion `text` answers the problem described by `meta` (its sample's metadata)."""
    ans = extract_answer(task, text)
    if ans is None:
        return False
    if task == "arithmetic":
        return ans == str(int(meta["answer"]))
    if task == "countdown":
        tree = ast.parse(ans, mode="eval").body
        return (Counter(_numbers_used(tree)) == Counter(int(n) for n in meta["numbers"])
                and _eval_expr(tree) == int(meta["target"]))
    from difrl.rewards.sudoku_cells import solved

    puzzle = torch.as_tensor([int(c) if c != "." else 0 for c in meta["puzzle"].replace("/", "")]).reshape(1, 16)
    grid = torch.as_tensor([int(c) for c in ans.replace("/", "")]).reshape(1, 16)
    keeps_givens = bool(((puzzle == 0) | (puzzle == grid)).all())
    return keeps_givens and bool(solved(grid, puzzle)[0])


def _check(name: str, texts, metadata) -> None:
    if not isinstance(texts, (list, tuple)) or any(not isinstance(t, str) for t in texts):
        raise ValueError(f"{name} scores completions as a list of str (the text world's decode), got {type(texts).__name__}")
    if metadata is None or any("task" not in m for m in metadata):
        raise ValueError(f"{name} needs each sample's metadata to name its task ({{'task': one of {TEXT_TASKS}, ...}})")


@register_reward("text_correct")
def text_correct():
    """1 when the completion's extracted answer solves its problem (metadata 'task' and the task's fields), else 0."""

    def score(texts: list[str], prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        _check("text_correct", texts, metadata)
        return torch.tensor([float(is_correct(m["task"], t, m)) for t, m in zip(texts, metadata)])

    return score


@register_reward("text_format")
def text_format():
    """1 when the completion (cut at EOS) is a well-formed answer of its task, whatever its value, else 0."""

    def score(texts: list[str], prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        _check("text_format", texts, metadata)
        return torch.tensor([float(extract_answer(m["task"], t) is not None) for t, m in zip(texts, metadata)])

    return score


__all__ = ["TEXT_TASKS", "extract_answer", "is_correct", "text_correct", "text_format"]

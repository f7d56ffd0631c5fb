"""Reward plug-ins (docs/architecture.md seam 4): found by name, extended by third-party packages.

    fn = build_reward("digit_prob")                          # or "mypkg.rewards:brightness"
    scores = fn(images, prompts, metadata)                  # {"digit_prob": [B] float32 CPU tensor, ...}

A reward factory takes keyword options (from the config's ``reward.options.<name>``) and returns
a callable ``(samples, prompts, metadata) -> [B] tensor | dict[str, [B] tensor]``: images
[B, 3, H, W] in [0, 1], videos [B, F, 3, H, W], token sequences for masked worlds. A dict's main
score is the entry named like the reward; its other entries are logged as ``<name>/<key>``.
``name@alias`` builds the reward ``name`` and files its scores under ``alias`` (one reward twice with
other options, ``remote@hps`` and ``remote@ocr``, each with its ``reward.options.<name@alias>``). The
callable may declare ``modality``, ``device``, ``dtype``, ``batch_size`` (subclass
``difrl.rewards.base.RewardModel``); ``build_reward`` wraps it in a ``Reward`` that scores in
chunks on that device, under inference mode, and checks the shapes. A factory that declares
``differentiable = True`` can also score with a graph to the samples (reward backpropagation: difrl.rewards.grad,
``differentiable(name)``). Factories are found, in
order, in the built-in table, as a ``module:function`` path, or under the ``difrl.rewards``
entry-point group of installed packages::

    [project.entry-points."difrl.rewards"]
    brightness = "myreward:brightness"
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from importlib.metadata import entry_points
from pathlib import Path
from typing import Callable

import torch

from difrl.rewards.base import MODALITIES, RewardConfigError, RewardModel, sha256_files  # noqa: F401

RewardFn = Callable[..., dict[str, torch.Tensor]]
REWARDS: dict[str, Callable[..., RewardFn]] = {}


def register_reward(name: str):
    """Decorator adding a factory to the built-in table."""
    def deco(factory):
        REWARDS[name] = factory
        return factory
    return deco


@lru_cache(maxsize=1)
def _entry_point_rewards() -> dict:
    return {ep.name: ep for ep in entry_points(group="difrl.rewards")}


def reward_key(name: str) -> str:
    """The name a reward's scores are filed under: the alias of ``name@alias``, else the function of
    ``module:function``, else the name."""
    base, _, alias = name.partition("@")
    return alias or base.rsplit(":", 1)[-1]


def import_user_module(module: str):
    """importlib.import_module, also finding a module in the current directory: where a user's reward file
    usually lives, which `python -m` puts on sys.path but the `difrl` console script and scripts/*.py do not
    (appended, so it never shadows an installed package)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        top, cwd = module.split(".")[0], os.getcwd()
        if e.name != top or cwd in sys.path or not (Path(cwd, f"{top}.py").is_file() or Path(cwd, top).is_dir()):
            raise
        sys.path.append(cwd)
        return importlib.import_module(module)


def find_reward_factory(name: str) -> Callable[..., RewardFn]:
    name = name.partition("@")[0]
    _load_builtins()
    if name in REWARDS:
        return REWARDS[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            return getattr(import_user_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"reward {name!r}: cannot import {attr!r} from {module!r} ({e}); the module must be a file "
                             "or package in the current directory or on PYTHONPATH") from e
    eps = _entry_point_rewards()
    if name in eps:
        return eps[name].load()
    raise ValueError(unknown_reward(name))


def unknown_reward(name: str) -> str | None:
    """Why `name` (``name@alias`` too) names no reward, with a "did you mean" for a near miss; None when it is a
    built-in or an entry point, or a ``module:function`` path (imported only when the reward is built)."""
    import difflib

    name = name.partition("@")[0]
    _load_builtins()
    known = sorted(REWARDS) + sorted(n for n in _entry_point_rewards() if n not in REWARDS)
    if ":" in name or name in known:
        return None
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return (f"unknown reward {name!r}; " + (f"did you mean {close[0]!r}? " if close else "")
            + f"known rewards: {', '.join(known)} (or give a 'module:function' path)")


def differentiable(name: str) -> bool:
    """Whether the reward `name` (``name@alias``, ``module:function``, an entry point) declares a score that is a
    differentiable function of the samples (``differentiable = True`` on its factory: a RewardModel class attribute or
    a function attribute), without building it: reward backpropagation (train.objective=draft / refl) refuses the
    others when the config is read. Raises ValueError for an unknown reward."""
    return bool(getattr(find_reward_factory(name), "differentiable", False))


def describe_rewards() -> str:
    """One line per known reward (built-ins, then entry points): name, modality, options, summary."""
    import inspect

    _load_builtins()
    lines = []
    entries = [(n, f) for n, f in sorted(REWARDS.items())] + [(n, ep) for n, ep in sorted(_entry_point_rewards().items())
                                                               if n not in REWARDS]
    for name, factory in entries:
        if not callable(factory):  # an entry point: described without importing it
            lines.append(f"{name:24s} entry point {factory.value}")
            continue
        try:
            params = ", ".join(f"{p.name}={p.default!r}" if p.default is not p.empty else p.name
                               for p in inspect.signature(factory).parameters.values())
        except (TypeError, ValueError):
            params = "?"
        doc = (inspect.getdoc(factory) or "").split("\n")[0]
        lines.append(f"{name:24s} [{getattr(factory, 'modality', 'any')}] ({params})\n{'':24s} {doc}")
    return "\n".join(lines)


def build_reward(name: str, **options) -> "Reward":
    factory = find_reward_factory(name)
    try:
        fn = factory(**options)
    except TypeError as e:  # an unknown or missing option: say which reward and what it takes
        import inspect

        try:
            accepted = ", ".join(inspect.signature(factory).parameters)
        except (TypeError, ValueError):
            accepted = "?"
        raise RewardConfigError(f"reward {name!r}: bad options {sorted(options)} ({e}); it takes: {accepted}") from e
    reward = Reward(name, fn)
    reward.differentiable |= bool(getattr(factory, "differentiable", False))  # a function factory declares it
    return reward


class RewardContractError(ValueError):
    """A reward broke the protocol (samples of the wrong modality, a missing score key, the wrong number of
    scores): a bug to fix, so it stops the run under every reward.on_error policy."""


class RewardTimeoutError(RuntimeError):
    """A reward call still running after ``reward.timeout`` seconds. Its thread cannot be cancelled and may
    still hold (and later change) the reward's model, so it stops the run under every reward.on_error."""


class Reward:
    """A built reward: calls the plug-in in chunks of its ``batch_size``, with the samples moved to its
    ``device`` and ``dtype``, in eval mode under ``torch.inference_mode()``, and returns
    ``{key: float32 [B] on the CPU, "key/extra": ...}`` where ``key`` is the reward's name (the part after
    ``:`` for a ``module:function``). A plug-in without those attributes scores the whole batch at once.
    With ``timeout`` (seconds, set from reward.timeout) a call runs in a daemon thread and raises
    RewardTimeoutError when it has not returned by then; a reward that timed out refuses further calls."""

    timeout: float | None = None  # seconds per call; None: wait forever, in the caller's thread
    hung: bool = False  # a call timed out and may still be running

    def __init__(self, name: str, fn):
        self.name, self.fn = name, fn
        self.key = reward_key(name)  # where the scores are filed
        self.own_key = name.partition("@")[0].rsplit(":", 1)[-1]  # where the plug-in puts its main score
        self.modality = getattr(fn, "modality", "any")
        if self.modality not in MODALITIES:
            raise RewardConfigError(f"reward {name!r} declares modality {self.modality!r}; expected one of {MODALITIES}")
        self.device = getattr(fn, "device", None)
        self.dtype = getattr(fn, "dtype", None)
        self.batch_size = getattr(fn, "batch_size", None)
        self.differentiable = bool(getattr(fn, "differentiable", False))  # the built callable's own declaration
        if isinstance(fn, torch.nn.Module):
            fn.eval()

    def __repr__(self) -> str:
        return f"Reward({self.name!r}, modality={self.modality}, device={self.device}, batch_size={self.batch_size})"

    def info(self) -> dict:
        """Name, declared input and the weights' identity (for run reports and the reward server)."""
        return {"name": self.name, "key": self.key, "modality": self.modality,
                "device": None if self.device is None else str(self.device),
                "dtype": None if self.dtype is None else str(self.dtype).replace("torch.", ""),
                "batch_size": self.batch_size, "version": str(getattr(self.fn, "version", "1")),
                "weights_sha256": getattr(self.fn, "weights_sha256", None) or sha256_files(getattr(self.fn, "weight_files", []))}

    def _check(self, samples) -> None:
        if self.modality in ("image", "video"):
            want = 4 if self.modality == "image" else 5
            if not torch.is_tensor(samples) or samples.ndim != want or samples.shape[-3] != 3:
                shape = tuple(samples.shape) if torch.is_tensor(samples) else type(samples).__name__
                layout = "[B, 3, H, W]" if want == 4 else "[B, F, 3, H, W]"
                raise RewardContractError(f"reward {self.name!r} scores {self.modality}s {layout} in [0, 1]; got {shape}"
                                 + (" (a video reward over image frames: use reward 'video' with image_reward=...)"
                                    if self.modality == "image" and torch.is_tensor(samples) and samples.ndim == 5 else ""))

    def _prepare(self, chunk):
        # a reward that declares no device gets its samples on the CPU, wherever they were sampled: on a GPU run the
        # decoded chunk arrives on the GPU (rollouts stay there), and a plain function may call .numpy() on it
        if not torch.is_tensor(chunk):
            return chunk
        device = self.device if self.device is not None else "cpu"
        if self.modality in ("tokens", "any"):
            return chunk.to(device)
        return chunk.to(device=device, dtype=self.dtype or chunk.dtype)

    def __call__(self, samples, prompts: list[str], metadata: list[dict] | None = None) -> dict[str, torch.Tensor]:
        if self.timeout is None:
            return self._score(samples, prompts, metadata)
        if self.hung:
            raise RewardTimeoutError(f"reward {self.name!r} timed out earlier and that call may still be running")
        box: dict = {}
        threads = torch.get_num_threads()  # per OS thread: the worker keeps the caller's count (same kernels, same
        cuda = torch.cuda.current_device() if torch.cuda.is_initialized() else None  # scores) and CUDA device

        def work():
            torch.set_num_threads(threads)
            if cuda is not None:
                torch.cuda.set_device(cuda)
            try:
                box["out"] = self._score(samples, prompts, metadata)
            except BaseException as e:  # handed back to the caller's thread
                box["error"] = e

        # a daemon thread: one that never returns does not keep the process alive at exit
        worker = threading.Thread(target=work, name=f"difrl-reward-{self.key}", daemon=True)
        worker.start()
        worker.join(self.timeout)
        if worker.is_alive():
            self.hung = True
            raise RewardTimeoutError(f"reward {self.name!r} did not return within reward.timeout={self.timeout:g} s "
                                     f"on a chunk of {len(prompts)} samples (a hang, or raise reward.timeout)")
        if "error" in box:
            raise box["error"]
        return box["out"]

    def _score(self, samples, prompts: list[str], metadata: list[dict] | None) -> dict[str, torch.Tensor]:
        self._check(samples)
        B = len(prompts)
        metadata = metadata if metadata is not None else [{} for _ in range(B)]
        bs = self.batch_size or max(B, 1)
        parts: list[dict[str, torch.Tensor]] = []
        with torch.inference_mode():
            for lo in range(0, B, bs):
                res = self.fn(self._prepare(samples[lo:lo + bs]), prompts[lo:lo + bs], metadata[lo:lo + bs])
                parts.append(self._as_dict(res, min(bs, B - lo)))
        if not parts:
            return {self.key: torch.zeros(0)}
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}

    def _as_dict(self, res, n: int) -> dict[str, torch.Tensor]:
        if not isinstance(res, dict):
            res = {self.own_key: res}
        if self.own_key not in res:
            raise RewardContractError(f"reward {self.name!r} must return a [B] tensor or a dict with its score under "
                             f"{self.own_key!r}, got keys {sorted(res)}")
        out = {}
        for k, v in res.items():
            k = self.key if k == self.own_key else k
            try:
                t = torch.as_tensor(v).detach().to("cpu", torch.float32).flatten()
            except (TypeError, ValueError, RuntimeError) as e:  # a string, None, an object: not scores
                raise RewardContractError(f"reward {self.name!r} returned {type(v).__name__} under {k!r}, not a [B] "
                                          f"tensor of scores ({e})") from e
            if t.shape[0] != n:
                raise RewardContractError(f"reward {self.name!r} returned {t.shape[0]} values under {k!r} for {n} "
                                          "samples")
            out[k] = t
        return out


# The built-in reward modules: each registers its rewards with @register_reward when imported, and imports its
# heavy packages (open_clip, transformers, rapidocr) only when a reward is built. A new built-in reward is its
# file in difrl/rewards/ plus its module name here.
BUILTIN_MODULES = ("clip", "digits", "geneval", "hps", "imagereward", "jpeg", "moving_digits", "ocr", "remote",
                   "simple", "sudoku_cells", "text_tasks", "video")


def _load_builtins() -> None:
    for module in BUILTIN_MODULES:
        importlib.import_module(f"difrl.rewards.{module}")


class RewardError(RuntimeError):
    """A reward raised, or returned NaN/inf or the wrong shape, for some samples; names them."""

    def __init__(self, message: str, bad: torch.Tensor, scores: dict[str, torch.Tensor] | None = None,
                 contract: bool = False):
        super().__init__(message)
        self.bad = bad  # [B] bool
        self.scores = scores  # every reward's [B] scores, NaN where bad
        self.contract = contract  # a RewardContractError or RewardTimeoutError among the causes: always stops


@dataclass
class _Failed:
    """One reward's failure on some samples (kept as a value so a scoring thread can hand it back)."""
    error: BaseException
    bad: torch.Tensor  # [n] bool


def call_rewards(rewards: dict, samples, prompts: list[str], metadata: list[dict], decode=None) -> dict:
    """name -> that reward's output dict, or _Failed: nothing raises here (this may run in a scoring thread).
    `decode` (latents -> samples) runs first when given, so the decode also leaves the sampling thread."""
    n = len(prompts)
    try:
        samples = decode(samples) if decode is not None else samples
    except Exception as e:  # the decode failed: every reward fails on every sample of the chunk
        return {name: _Failed(e, torch.ones(n, dtype=torch.bool)) for name in rewards}
    out = {}
    for name, fn in rewards.items():
        try:
            out[name] = (fn if isinstance(fn, Reward) else Reward(name, fn))(samples, prompts, metadata)
        except Exception as e:
            out[name] = _Failed(e, torch.ones(n, dtype=torch.bool))
    return out


class Scoring:
    """Scores a rollout chunk by chunk as the chunks are sampled; with ``overlap`` in one background thread,
    so chunk k is decoded and scored while chunk k + 1 samples (ddpo-pytorch's executor pattern). Each reward sees
    the same chunks either way, so the scores equal serial scoring wherever the reward's CPU kernels do not depend
    on the thread count (the thread runs torch with one intra-op thread; identical on the digits world, tested).

        scoring = Scoring(rewards, overlap=True)
        for chunk in chunks: scoring.submit(latents, prompts, metadata, decode=policy.decode)
        scores = scoring.result(prompt_ids, seeds)      # name -> [B], or RewardError naming the samples
    """

    def __init__(self, rewards: dict, overlap: bool = False):
        self.rewards = rewards
        # the scoring thread gets ONE torch intra-op thread (torch.set_num_threads is per OS thread): with the
        # sampler's full count there too, the two OpenMP teams oversubscribe the cores and spin against each other
        # (measured: a 4x slowdown on 2 cores). Reward models on a GPU or in onnxruntime keep their own threads.
        self.pool = (ThreadPoolExecutor(1, thread_name_prefix="difrl-reward", initializer=torch.set_num_threads,
                                        initargs=(1,)) if overlap else None)
        self.parts: list = []  # per chunk: a Future or the finished dict

    def submit(self, samples, prompts: list[str], metadata: list[dict], decode=None) -> None:
        job = (call_rewards, self.rewards, samples, list(prompts), list(metadata), decode)
        self.parts.append(self.pool.submit(*job) if self.pool is not None else job[0](*job[1:]))

    def result(self, prompt_ids: torch.Tensor, seeds: torch.Tensor) -> dict[str, torch.Tensor]:
        parts = [p.result() if isinstance(p, Future) else p for p in self.parts]
        self.parts = []
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
        merged = {}
        for name in self.rewards:
            chunks = [p[name] for p in parts]
            failed = [c for c in chunks if isinstance(c, _Failed)]
            if failed:
                bad = torch.cat([c.bad if isinstance(c, _Failed) else torch.zeros(len(next(iter(c.values()))), dtype=torch.bool)
                                 for c in chunks])
                merged[name] = _Failed(failed[0].error, bad)
            else:
                merged[name] = {k: torch.cat([c[k] for c in chunks]) for k in chunks[0]}
        return check_scores(merged, prompt_ids, seeds)


def _where(prompt_ids: torch.Tensor, seeds: torch.Tensor, bad: torch.Tensor) -> str:
    idx = bad.nonzero().flatten()
    return (f"{len(idx)} of {len(bad)} samples (prompt ids {sorted(set(prompt_ids[idx].tolist()))[:8]}, "
            f"seeds {seeds[idx].tolist()[:8]})")


def check_scores(results: dict, prompt_ids: torch.Tensor, seeds: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every reward's outputs -> {key: [B], "key/extra": [B]}; raises RewardError when a reward raised or
    returned NaN/inf, with `bad` marking the failed samples and `scores` holding NaN for them (never 0)."""
    B = len(prompt_ids)
    out: dict[str, torch.Tensor] = {}
    bad = torch.zeros(B, dtype=torch.bool)
    problems, contract, first_error = [], False, None
    for name, res in results.items():
        key = reward_key(name)
        if isinstance(res, _Failed):
            e = res.error
            first_error = first_error or e
            contract |= isinstance(e, (RewardContractError, RewardTimeoutError))  # both stop under every on_error
            problems.append(f"reward {name!r} raised {type(e).__name__}: {e} on {_where(prompt_ids, seeds, res.bad)}")
            bad |= res.bad
            out[key] = torch.full((B,), float("nan"))
            continue
        score = res[key]
        nonfinite = ~torch.isfinite(score)
        if nonfinite.any():
            idx = nonfinite.nonzero().flatten()
            problems.append(f"non-finite reward {name!r}: {score[idx][:4].tolist()} for {_where(prompt_ids, seeds, nonfinite)}")
            bad |= nonfinite
        out[key] = score
        out.update({f"{key}/{k}": v for k, v in res.items() if k != key})
    if problems:
        for k in out:  # a failed sample has no score under any reward
            out[k] = torch.where(bad, float("nan"), out[k])
        # the first reward's own exception stays in the chain (its traceback; a timeout recognisable through it)
        raise RewardError("; ".join(problems), bad, out, contract) from first_error
    return out


def score_all(rewards: dict, samples, prompts: list[str], metadata: list[dict],
              seeds: torch.Tensor, prompt_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Run every reward on one batch; each must return a finite [B] score under its own name.

    A reward that raises, returns NaN/inf or the wrong number of scores raises RewardError naming the
    reward and the prompt ids and seeds of the failing samples (`bad` marks them, so a caller may drop
    their groups)."""
    return check_scores(call_rewards(rewards, samples, prompts, metadata), prompt_ids, seeds)

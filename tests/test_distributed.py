"""Two processes (torchrun, gloo on CPU) train exactly what one process trains.

    .venv/bin/python -m pytest tests/test_distributed.py -q

One process accumulates 4 micro-batches of 2 per update; two processes accumulate 2 each and
DDP averages their gradients: the same 8 samples, the same update (up to float summation order).
The one-process run is `difrl train` called in the test process (the code `python -m difrl train` runs, without
a second start-up of torch, peft and transformers); the two processes are a torchrun launch: one for all the
tests' 2-process runs (tests/many_runs.py, fixture two_processes) and one for the resume past a damaged checkpoint.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from difrl.train.flow.trainer import TIMING_KEYS
from difrl.utils.io import load_safetensors_checked

ROOT = Path(__file__).resolve().parent.parent
# Adam's first step is ~lr * sign(g); adam_eps = 1 keeps the update proportional to the gradient
COMMON = [
    "seed=3", "threads=1", "sampler.num_steps=4", "rollout.prompts_per_iter=2", "rollout.group_size=4",
    "train.micro_batch=6", "train.iterations=2", "train.adam_eps=1.0", "train.lr=1.0", "train.weight_decay=0",
    "train.kl_beta=0.1", "eval.every=0", "eval.per_digit=3", "eval.num_steps=3",
    "train.updates_per_epoch=null",  # digits.yaml's 2 updates per rollout: these runs make 1 of 8 samples
]


def in_this_process(args: list[str]) -> str:
    """`python -m difrl ARGS` as difrl.cli.main in the test process (its output; it must exit 0): the code a fresh
    process runs, without paying its start-up (torch, peft, transformers: seconds) once more. The thread count a
    run sets is put back after it."""
    from difrl.cli import main

    threads, log = torch.get_num_threads(), io.StringIO()
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            code = main(args)
    finally:
        torch.set_num_threads(threads)
    assert code == 0, log.getvalue()[-3000:]
    return log.getvalue()


def _train(out: Path, nproc: int, *overrides: str) -> str:
    args = ["train", str(ROOT / "configs" / "digits.yaml"), *COMMON, *overrides, "--out", str(out)]
    if nproc == 1:
        return in_this_process(args)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "difrl",
           *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def _weights(run_dir: Path, iteration: int) -> dict[str, torch.Tensor]:
    path = run_dir / "checkpoints" / f"iter-{iteration:06d}" / "trainable.safetensors"
    return load_safetensors_checked(path, "weights")[0]


def _assert_same_runs(one: Path, two: Path, exact: tuple[str, ...], reduced: tuple[str, ...], iteration: int = 2,
                      rtol: float = 1e-3, atol: float = 1e-6) -> None:
    """Metric rows agree (`exact`: from gathered values; `reduced`: means over processes, float summation
    order differs) and so do the trainable weights at `iteration`."""
    r1, r2 = _rows(one), _rows(two)
    assert len(r1) == len(r2)
    for a, b in zip(r1, r2):
        for k in exact:  # gathered values: the same numbers up to fp32 reordering of their means
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k
        for k in reduced:  # means over processes of per-process means: summation order over 2 x 4 vs 8 samples
            assert a[k] == pytest.approx(b[k], rel=1e-3, abs=1e-7), k
    w1, w2 = _weights(one, iteration), _weights(two, iteration)
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], rtol=rtol, atol=atol, msg=k)


SOLRL_NFT = ["rollout.kind=solrl", "solrl.candidates=8", "solrl.preview_steps=3", "train.objective=nft",
             "nft.ref_beta=0.1", "train.kl_beta=0", "train.clip_low=1e-4", "train.clip_high=1e-4",
             "train.micro_batch=4"]  # 2 samples x 2 trained sigmas per micro-batch
TREES = ["rollout.kind=tree", "tree.split_steps=[0,1]", "tree.noise_scale=2.0", "train.micro_batch=5"]
# the 2-process runs of the tests below: name -> their overrides
TWO = {"two": [], "solrl_nft": SOLRL_NFT, "trees": TREES,
       "full": ["train.iterations=4", "checkpoint_every=1"], "part": ["train.iterations=3", "checkpoint_every=1"]}


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> dict[str, Path]:
    """name -> run dir of TWO's 2-process runs (train.grad_accum=2), all in ONE torchrun launch (tests/many_runs.py:
    each run on a process group of its own, as a launch of its own would be; the launch's start-up, torch and peft in
    2 processes, is paid once). `part` is the resume test's own (it damages and resumes it)."""
    root = tmp_path_factory.mktemp("two_processes")
    plan = [{"kind": None, "argv": ["train", str(ROOT / "configs" / "digits.yaml"), *COMMON, *extra,
                                    "train.grad_accum=2", "--out", str(root / name)]} for name, extra in TWO.items()]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "many_runs.py"), json.dumps(plan)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {name: root / name for name in TWO}


@pytest.mark.slow  # end to end, several seconds: left out by `make test-fast`
def test_two_processes_equal_one(two_processes, tmp_path):
    one, two = tmp_path / "one", two_processes["two"]
    _train(one, 1, "train.grad_accum=4")
    # same samples and gathered rewards; metrics reduced over both processes
    _assert_same_runs(one, two, ("reward_mean", "reward_std", "adv_mean", "adv_std", "trained_samples", "zero_spread_groups"),
                      ("kl", "approx_kl", "grad_norm", "loss", "clip_high", "clip_low"))
    assert len(_rows(one)) == 2
    assert all(a["ratio_per_step"].keys() == b["ratio_per_step"].keys() for a, b in zip(_rows(one), _rows(two)))
    assert any(float(w.abs().max()) > 1e-3 for k, w in _weights(one, 2).items() if "lora_B" in k)  # training moved B


@pytest.mark.slow  # end to end, several seconds: left out by `make test-fast`
def test_two_processes_equal_one_for_solrl_with_nft(two_processes, tmp_path):
    # the candidate pool is split over processes too: its rewards are gathered before seeds are selected. Candidates
    # at fp32 here (SOLRL_NFT): NVFP4 scales activations per tensor, i.e. over each process's forward batch (as TE
    # does), so an NVFP4 pool split over processes is quantized slightly differently and may select other seeds
    one, two = tmp_path / "one", two_processes["solrl_nft"]
    _train(one, 1, *SOLRL_NFT, "train.grad_accum=4")
    _assert_same_runs(one, two, ("reward_mean", "solrl/spearman_median", "solrl/candidate_reward_mean", "nfe_lowprec",
                                 "nfe_full"), ("loss", "nft_loss_pos", "kl", "grad_norm"))


@pytest.mark.slow  # end to end, several seconds: left out by `make test-fast`
def test_two_processes_equal_one_for_trees(two_processes, tmp_path):
    # one tree per process (TREES); the 20 edges of both trees form one update (advantages are per tree, so no
    # process needs another's rewards): 1 x (4 micro-batches of 5) == 2 x (2 of 5), gradients averaged by DDP
    one, two = tmp_path / "one", two_processes["trees"]
    _train(one, 1, *TREES, "train.grad_accum=4")
    _assert_same_runs(one, two, ("reward_mean", "reward_std", "nfe_full", "nfe_train", "tree/edges_trained",
                                 "tree/edge_adv_abs_mean"), ("kl", "loss", "grad_norm", "clip_high", "clip_low"))


@pytest.mark.slow  # end to end, several seconds: left out by `make test-fast`
def test_resume_under_two_processes_past_a_damaged_checkpoint(two_processes):
    # 3 iterations, the newest checkpoint's weights damaged (flipped bytes), resume to 4 (all under 2 processes):
    # both processes fall back to iteration 2's checkpoint and the run == 4 iterations without a stop
    from test_checkpoint_integrity import flip_data_bytes

    full, part = two_processes["full"], two_processes["part"]  # 4 and 3 iterations (TWO)
    flip_data_bytes(part / "checkpoints" / "iter-000003" / "trainable.safetensors")
    out = _train(part, 2, "train.grad_accum=2", "train.iterations=4", "checkpoint_every=1", f"resume={part}")
    assert "trainable.safetensors does not match its SHA-256" in out and "iter-000002 after iteration 2" in out, out[-3000:]
    assert [r["iteration"] for r in _rows(part)] == [1, 2, 3, 4]
    _assert_same_runs(full, part, ("reward_mean", "loss", "grad_norm", "kl"), (), iteration=4, rtol=1e-5, atol=1e-7)

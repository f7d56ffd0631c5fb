"""The data-parallel masked trainer (difrl/train/masked/plan.py): 2 CPU processes (gloo) train what one process trains.

    HF_HUB_OFFLINE=1 python -m pytest tests/test_masked_dp.py -q          # the end-to-end ones are marked slow

Each world (Sudoku; the text task with the bundled BertForMaskedLM, tied embeddings) is trained once on one plain
process (`difrl train` in the test process; a module-scoped reference shared by the DDP and the FSDP comparison) and
on 2 processes launched by `accelerate launch --config_file configs/accelerate/{ddp,fsdp}.yaml --num_processes 2`
(one launch per config runs its 2-process runs one after another: tests/many_runs.py), with the same command-line
keys: `train.micro_batch=auto` gives 1 process one micro-batch of all samples and each of 2 processes one of half of
them, one optimizer update per inner update either way. Over 3 iterations every metric
row, the evaluation after training and the checkpoint (weights, AdamW moments) agree within rtol 1e-5
(tests/test_fsdp.py's assert_same_runs); only the first micro-step's |log ratio| is float noise of different
micro-batches on either side (checked below the ratio check's tolerance instead). Adam's eps = 1 keeps an update
proportional to its gradient (tests/test_fsdp.py) and lr = 0.1 moves a weight by about a tenth of it: the float
noise of the two sides' different micro-batches (12 or 8 sequences in one forward against 6 or 4) then stays below
rtol 1e-5 (with lr = 1 the text world's token-type embedding differed by 2e-7 at a value of 0.01 after 3 iterations,
about 10 float32 steps).

The Sudoku runs take external rollouts (ERILS, the solver: the last of every group, normalised by source) with 3
groups of 4 over 2 processes, so group 1 spans them; the KL to the reference is on in both worlds. Each launch
kind is also resumed once after 2 iterations on 2 processes (checkpoints gathered, written once by the main
process), and that resumed run is what is compared.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from test_fsdp import ACCELERATE, ROOT, assert_same_runs, checkpoint_tensors, env, free_port, rows

from difrl.config import ConfigError
from difrl.train.masked.config import load_masked_config
from difrl.train.masked.plan import plan_masked_iteration
from difrl.utils.io import load_safetensors_checked
from tolerances import MASKED_FIRST_STEP_LOG_RATIO

COMMON = ["seed=3", "threads=1", "train.micro_batch=auto", "train.updates_per_epoch=1", "train.grad_accum=1",
          "train.inner_updates=2", "train.lr=0.1", "train.adam_eps=1.0", "train.weight_decay=0", "train.kl_beta=0.1",
          "checkpoint_every=1", "eval.every=0"]
WORLDS = {
    # 12 samples: 3 groups of 4, the last of each from the solver; 6 per process, so group 1 spans both
    "sudoku": ("sudoku.yaml", ["rollout.prompts_per_iter=3", "rollout.group_size=4", "eval.count=4",
                               "external.source=solver", "external.per_group=1"]),
    "text": ("text_arithmetic.yaml", ["rollout.prompts_per_iter=2", "rollout.group_size=4", "eval.count=4",
                                      "eval.samples=2", "eval.pass_k=[1]"]),
}
# launch kind -> the world whose 2-process run stops after 2 iterations and is resumed to 3
RESUMED = {"ddp": "sudoku", "fsdp": "text"}


def args(world: str, out: Path, *extra: str) -> list[str]:
    """`difrl train` of `world` into `out`: its command line (after `python -m difrl`)."""
    config, keys = WORLDS[world]
    return ["train", str(ROOT / "configs" / config), *COMMON, *keys, *extra, "--out", str(out)]


def train(world: str, out: Path, *extra: str) -> str:
    """`difrl train` of `world` on one process, in this one (tests/test_distributed.py's in_this_process, without
    a second start-up of torch and transformers); its output."""
    from test_distributed import in_this_process

    return in_this_process(args(world, out, *extra))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """world -> its one-process run of 3 iterations (run on first use, shared by the DDP and FSDP comparisons)."""
    runs = {}

    def get(world: str) -> Path:
        if world not in runs:
            out = tmp_path_factory.mktemp("one") / world
            train(world, out, "train.iterations=3")
            runs[world] = out
        return runs[world]

    return get


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """launch kind -> {world: (its 2-process run dir, the launch output of that world's runs)}, on first use. ONE
    launch per kind runs its three 2-process runs one after another (tests/many_runs.py: each on a process group of its
    own, as a launch of its own would be; the launch's start-up, torch and transformers in 2 processes, is paid once):
    RESUMED[kind]'s world for 2 iterations, that run resumed to 3, the other world for 3."""
    launches = {}

    def get(launch: str) -> dict[str, tuple[Path, str]]:
        if launch not in launches:
            root = tmp_path_factory.mktemp(f"two-{launch}")
            worlds = [w for w in sorted(WORLDS) if w != "text" or importlib.util.find_spec("transformers")]
            resumed, dirs = RESUMED[launch], {w: root / w for w in worlds}
            runs = [(w, ["train.iterations=2"] if w == resumed else ["train.iterations=3"]) for w in worlds]
            runs.insert(runs.index((resumed, ["train.iterations=2"])) + 1, (resumed, [f"resume={dirs[resumed]}",
                                                                                       "train.iterations=3"]))
            plan = [{"kind": None, "argv": args(w, dirs[w], *extra)} for w, extra in runs]
            cmd = [str(ACCELERATE), "launch", "--config_file", str(ROOT / "configs" / "accelerate" / f"{launch}.yaml"),
                   "--num_processes", "2", "--main_process_port", str(free_port()),
                   str(ROOT / "tests" / "many_runs.py"), json.dumps(plan)]
            proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=900)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
            # the main process prints its run's lines, then (flushed) "many_runs: run i/N ..." to stdout: the text
            # before the i-th of those lines and after the one before is run i's
            parts = re.split(r"many_runs: run \d/\d on its own process group[^\n]*\n", proc.stdout)
            assert len(parts) == len(runs) + 1, proc.stdout[-3000:] + proc.stderr[-5000:]
            launches[launch] = {w: (dirs[w], "".join(part for (v, _), part in zip(runs, parts) if v == w))
                                for w in worlds}
        return launches[launch]

    return get


@pytest.mark.slow  # 2 launches of 2 processes (3 runs each: tests/many_runs.py) + 2 one-process runs
@pytest.mark.parametrize("launch", ["ddp", "fsdp"])
@pytest.mark.parametrize("world", sorted(WORLDS))
def test_two_processes_equal_one(world, launch, one_process, launched, tmp_path):
    if world == "text":
        pytest.importorskip("transformers")
    two, out = launched(launch)[world]
    if RESUMED[launch] == world:  # stopped after 2 iterations, resumed on 2 processes
        assert f"difrl: resumed from {two / 'checkpoints' / 'iter-000002'} after iteration 2" in out
    assert "2 process(es) x 1 thread(s)" in out and ("FSDP2 over 2 processes" in out) == (launch == "fsdp")
    one = tmp_path / "one"
    shutil.copytree(one_process(world), one)  # the shared reference stays as written
    shutil.copytree(two, tmp_path / "two")  # the launch's run too (its path is the one its resume line names)
    two = tmp_path / "two"
    # the first micro-step's max |log ratio| compares micro-batches of 12 (8) and 6 (4) sequences with the rollout's
    # log-probs: float noise on both sides, under the ratio check's tolerance
    for run in (one, two):
        assert all(r["first_step_max_abs_log_ratio"] <= MASKED_FIRST_STEP_LOG_RATIO for r in rows(run))
        lines = (run / "metrics.jsonl").read_text().splitlines()
        (run / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in json.loads(ln).items()
                                                               if k != "first_step_max_abs_log_ratio"}) + "\n"
                                                   for ln in lines))
    assert_same_runs(one, two)  # every metric row, eval_after, weights and AdamW moments, rtol 1e-5
    assert any(float(v.abs().max()) > 0 for k, v in checkpoint_tensors(two, 3).items() if k.startswith("opt/"))
    if world == "sudoku":
        assert all("external/reward_mean" in r for r in rows(two))
    if world == "text" and launch == "fsdp":
        assert "FSDP2 over 2 processes: 4 units (3 blocks of BertLayer + the root)" in out
        # policy.safetensors: the gathered weights, loadable into a plain transformers BertForMaskedLM
        from transformers import BertForMaskedLM

        from difrl.discrete.tiny_mlm import BUNDLED_DIR

        weights = load_safetensors_checked(two / "policy.safetensors", "policy")[0]
        model = BertForMaskedLM.from_pretrained(BUNDLED_DIR)
        missing, unexpected = model.load_state_dict(weights, strict=False)
        assert not unexpected and all("decoder" in k for k in missing), (missing, unexpected)  # the tied output weight
        trained = checkpoint_tensors(two, 3)
        for k, v in model.state_dict().items():
            if f"trainable/{k}" in trained:
                torch.testing.assert_close(v, trained[f"trainable/{k}"], rtol=0, atol=0, msg=k)  # exact: saved, loaded


# ---------------------------------------------------------------------------------- fast: the split and its errors


def _cfg(*keys: str):
    return load_masked_config(ROOT / "configs" / "sudoku.yaml", list(keys))


def test_the_bundled_configs_keep_their_updates_on_any_number_of_processes():
    # 128 samples; one process: 2 updates of 64 per inner update (what the configs' results were measured with)
    for name in ("sudoku", "digit_tokens", "text_arithmetic"):
        cfg = load_masked_config(ROOT / "configs" / f"{name}.yaml")
        for procs in (1, 2, 4, 8):
            split = plan_masked_iteration(cfg, procs, procs - 1)
            assert (split.per_proc, split.micro, split.updates) == (128 // procs, 64 // procs, 2), (name, procs)
            assert split.rows.tolist() == list(range(128 - 128 // procs, 128))  # the last process's slice


def test_a_batch_that_does_not_split_names_the_keys_and_the_nearest_values():
    with pytest.raises(ConfigError, match=r"128 samples per iteration \(rollout.prompts_per_iter x rollout.group_size "
                                          r"= 16 x 8\) do not split over 3 processes: use rollout.prompts_per_iter=15 "
                                          r"or 18 \(with rollout.group_size=8\), or rollout.group_size=6 or 9"):
        plan_masked_iteration(_cfg(), 3, 0)
    with pytest.raises(ConfigError, match=r"each of the 2 processes has 64 samples .* not a multiple of "
                                          r"train.micro_batch x train.grad_accum = 48 x 1 = 48: use "
                                          r"train.micro_batch=32 or 64 \(with train.grad_accum=1\), or train.micro_batch=auto"):
        plan_masked_iteration(_cfg("train.micro_batch=48", "train.updates_per_epoch=null"), 2, 0)
    with pytest.raises(ConfigError, match=r"train.micro_batch=auto takes whole sequences, but each of the 2 processes "
                                          r"has 64 samples, .* 2 x 3 micro-batches: use train.grad_accum=2 or 4"):
        plan_masked_iteration(_cfg("train.grad_accum=3"), 2, 0)
    with pytest.raises(ConfigError, match=r"32 x 1 make 4 optimizer update\(s\) per pass when the process has 128 "
                                          r"samples, but train.updates_per_epoch=2: use train.grad_accum=2 \(with "
                                          r"train.micro_batch=32\), or train.micro_batch=64"):
        plan_masked_iteration(_cfg("train.micro_batch=32"), 1, 0)
    split = plan_masked_iteration(_cfg("train.micro_batch=32", "train.updates_per_epoch=null"), 2, 1)  # explicit: its own updates
    assert (split.micro, split.updates, split.rows[0].item()) == (32, 2, 64)


def test_bench_masked_dp_sentences_are_computed_from_its_rows():
    # benchmarks/bench_masked_dp.py's block: the ratio, the loads and the agreement come from the rows given
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_masked_dp", ROOT / "benchmarks" / "bench_masked_dp.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def row(launch, procs, s, load, rewards):
        return {"launch": launch, "processes": procs, "seconds_per_iteration": s, "seconds_rollout": s / 4,
                "seconds_update": s / 2, "load_before": load, "reward_mean": rewards}

    rows = [row("1 process", 1, 2.0, 1.5, [0.5, 0.6]), row("2 processes, DDP", 2, 1.25, 2.5, [0.5, 0.6]),
            row("1 process", 1, 3.0, 0.5, [0.5, 0.6]), row("2 processes, DDP", 2, 1.75, 1.0, [0.5, 0.6000006])]
    lines, summary = bench.report(rows, 8, 128)
    text = "\n".join(lines)
    # the summary rows carry the block's ratios (median of 1 process / median of the launch): 2.5 / 1.5 here
    assert [(r["launch"], r["launches"]) for r in summary] == [("1 process", 2), ("2 processes, DDP", 2)]
    assert [r["speed_vs_one_process"] for r in summary] == pytest.approx([1.0, 2.5 / 1.5], rel=1e-12)  # float64 ratios
    assert "| 1 process | 1 x 1 | 2.500 |" in text and "| 2 processes, DDP | 2 x 1 | 1.500 |" in text
    assert "took 1.500 s against 2.500 s on one process: 1.67x as fast" in text
    assert "agrees within a relative 1.0e-06 across all 4 launches" in text and "load average 0.5 to 2.5" in text

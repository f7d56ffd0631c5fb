"""FSDP2 sharding (difrl/train/dist/sharding.py, full_tensors.py) on 2 CPU processes (gloo) equals one unsharded process.

    HF_HUB_OFFLINE=1 python -m pytest tests/test_fsdp.py -q            # the end-to-end ones are marked slow

Each sharded run is `accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes 2` (the
config users run, FSDP2, one unit per transformer block), against one plain process (the script run in the
test process: run_here) with the same global batch (1 process x accumulation 4 == 2 processes x 2) over 3
iterations: every metric row and the gathered checkpoint (trainable weights, EMA, optimizer moments) agree to
rtol 1e-5. Adam's eps = 1 keeps an update
proportional to its gradient, as in tests/test_distributed.py: with a tiny eps Adam turns the float noise of a
zero gradient (attention key biases) into full-size steps of random sign.

a. FLUX (tiny pipeline) full fine-tuning with the KL to a (sharded) frozen reference and EMA; its
   transformer/ loads with plain diffusers and holds the EMA weights. Killed by SIGKILL (launcher and both
   processes) after its second checkpoint and resumed: equal to the uninterrupted sharded run.
b. FLUX LoRA: the same equality; lora/ loads into a plain FluxPipeline with load_lora_weights.
c. bf16 mixed precision from the launch, and model.dtype=bf16 full fine-tuning (upcast before sharding): ratio 1 on
   the first micro-step, fp32 masters (and EMA, AdamW state) in the checkpoint; the latter's transformer/ in bf16.
   The uninterrupted two-process runs of a, b and c share one launch (tests/many_runs.py; fixture flux_launch).
d. The masked trainer (Sudoku; hf_masked: the bundled BertForMaskedLM, tied embeddings) under FSDP and DDP, its
   samples split over the processes: tests/test_masked_dp.py.
e. Fast: gathering, plain copies and checkpoint restore of sharded tensors (a one-process group in the test
   process); the settings accelerate's config gives, and what is refused with a reason (FSDP version 1, CPU
   offload on a process group without a CPU backend); block classes with a tied weight stay in the root unit.
   (Trees, Sol-RL and the rollout copy under FSDP: tests/test_fsdp_methods.py.)
f. fsdp_reshard_after_forward: false and fsdp_offload_params: true. Fast (one torchrun job of 2 processes): a
   forward after an EMA swap, a swap back and a checkpoint restore, each following a forward that left the units
   gathered, computes what one plain process computes with the weights written. Slow: digits with DiffusionNFT,
   EMA and an evaluation every iteration (weights swapped between forwards all along) equals the default run with
   either setting. On CPU processes offload moves nothing (mesh and shards are both on the CPU): NCCL and GPUs
   never ran (difrl/train/dist/sharding.py says what that leaves untested).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from difrl.train.flow.trainer import TIMING_KEYS
from difrl.utils.io import load_safetensors_checked
from tolerances import FP32_REORDER

ROOT = Path(__file__).resolve().parent.parent
FSDP_YAML = ROOT / "configs" / "accelerate" / "fsdp.yaml"
ACCELERATE = Path(sys.executable).with_name("accelerate")
# 8 samples per iteration; 1 process accumulates 4 micro-batches of 2 samples (x 2 steps = 4 transitions), 2 processes 2 each
FLUX = ["threads=1", "rollout.prompts_per_iter=2", "rollout.group_size=4", "sampler.num_steps=3", "eval.num_steps=3",
        "eval.per_digit=1", "train.iterations=3", "train.micro_batch=4", "train.lr=1.0", "train.adam_eps=1.0",
        "train.weight_decay=0", "checkpoint_every=1"]
# digits (a CPU world; its AdaLNBlocks are the units) with DiffusionNFT, EMA and an evaluation every iteration: each
# swaps weights into the shards between forwards (NFT's old policy also inside every micro-step); 4 samples x 2
# trained sigmas per process, 2 updates per iteration
DIGITS_NFT = ["seed=3", "threads=1", "rollout.kind=flat", "rollout.precision=fp32", "sampler.num_steps=4",
              "rollout.prompts_per_iter=2", "rollout.group_size=4", "train.micro_batch=4", "train.grad_accum=1",
              "train.iterations=2", "train.lr=1.0", "train.adam_eps=1.0", "train.weight_decay=0", "train.ema_decay=0.5",
              "nft.ref_beta=0.1", "eval.every=1", "eval.per_digit=2", "eval.num_steps=3", "checkpoint_every=1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(nproc: int, target: list[str], args: list[str], out: Path, launch: tuple[str, ...] = ()) -> list[str]:
    """`python TARGET ARGS --out OUT` for one plain process, else accelerate launch with the FSDP config (and the
    launcher's options `launch`, e.g. --mixed_precision bf16)."""
    if nproc == 1:
        return [sys.executable, *target, *args, "--out", str(out)]
    return [str(ACCELERATE), "launch", "--config_file", str(FSDP_YAML), "--num_processes", str(nproc), *launch,
            "--main_process_port", str(free_port()), *target, *args, "--out", str(out)]


def env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def run(nproc: int, target: list[str], args: list[str], out: Path, launch: tuple[str, ...] = ()) -> str:
    proc = subprocess.run(command(nproc, target, args, out, launch), env=env(), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout + proc.stderr


def run_here(target: list[str], args: list[str], out: Path) -> str:
    """run(1, ...) in the test process: the script `target` run as __main__ (the code `python TARGET` runs, without
    a second start-up of torch, diffusers, peft and transformers: seconds), its output; it must exit 0. The one-process
    reference of a comparison: a plain process initialises no process group, and none may be left behind (a later
    test in this process would inherit it); the thread count it sets is put back."""
    import contextlib
    import io
    import runpy

    import torch.distributed as dist

    threads, log, argv = torch.get_num_threads(), io.StringIO(), sys.argv
    sys.argv = [*target, *args, "--out", str(out)]
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            runpy.run_path(target[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code
    finally:
        sys.argv = argv
        torch.set_num_threads(threads)
    assert code in (0, None), log.getvalue()[-5000:]
    assert not dist.is_initialized(), "the one-process run left a process group initialised"
    return log.getvalue()


def run_killed_after(nproc: int, target: list[str], args: list[str], out: Path, checkpoint: int) -> None:
    """Start the run in its own process group and SIGKILL the launcher and every process it started as soon as
    checkpoint `checkpoint` is in place (a crash of the whole job). torch's launcher starts each worker in a session
    of its own (torch/distributed/elastic/multiprocessing/subprocess_handler: start_new_session=True), so killing
    the launcher's group alone would leave the workers training on, and finishing, into `out`: every descendant is
    killed by pid, and waited for."""
    import psutil  # accelerate's dependency

    proc = subprocess.Popen(command(nproc, target, args, out), env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    workers = []
    try:
        done = out / "checkpoints" / f"iter-{checkpoint:06d}"
        deadline = time.monotonic() + 600
        while not done.exists():
            assert proc.poll() is None, f"the run ended (status {proc.returncode}) before checkpoint {checkpoint}"
            assert time.monotonic() < deadline, "no checkpoint within 600 s"
            time.sleep(0.02)
    finally:
        try:
            workers = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:  # the launcher is gone already
            pass
        for p in [psutil.Process(proc.pid), *workers] if proc.poll() is None else workers:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        proc.wait()
        _, alive = psutil.wait_procs(workers, timeout=30)
        assert not alive, f"processes of the killed run still alive: {alive}"
    assert not (out / "summary.json").exists(), "the kill came after the run had finished"


def run_driver(source: str, tmp_path: Path, timeout: int = 600, nproc: int = 2) -> None:
    """`source` (its {tests} filled in) as a script under torchrun with `nproc` processes (gloo, torchrun's TCP
    store), given tmp_path; it must exit 0 (its output's tail otherwise)."""
    driver = tmp_path / "driver.py"
    driver.write_text(source.format(tests=str(ROOT / "tests")))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), str(driver),
           str(tmp_path)]
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def rows(run_dir: Path) -> list[dict]:
    out = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in out]


def checkpoint_tensors(run_dir: Path, iteration: int) -> dict[str, torch.Tensor]:
    """Trainable weights, EMA, the extras (DiffusionNFT's old policy, the stale rollout copy's source) and Adam's
    moments of one checkpoint, by a flat name; a sharded checkpoint (DCP, the default under FSDP) read whole in this
    process under the same names."""
    path = run_dir / "checkpoints" / f"iter-{iteration:06d}"
    if (path / ".metadata").exists():
        return sharded_checkpoint_tensors(path)
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        if file.stem != "rng":  # trainable, ema and every extra: NAME.safetensors
            out |= {f"{file.stem}/{k}": v for k, v in load_safetensors_checked(file, file.stem)[0].items()}
    opt = torch.load(path / "optimizer.pt", weights_only=True)
    out |= {f"opt/{i}/{k}": v for i, st in opt["state"].items() for k, v in st.items() if torch.is_tensor(v)}
    return out


def sharded_checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """checkpoint_tensors of a sharded checkpoint (difrl.train.run.sharded_state): its optimizer state is keyed by the
    parameter's name, a gathered one's by the parameter's index; DCP's .metadata lists the trainable weights in the
    order they were saved (trainable_params' order, the optimizer's), which gives the index."""
    from difrl.train.run.sharded_state import read_metadata, read_sharded

    names = [k[len("trainable/"):] for k in read_metadata(path).state_dict_metadata if k.startswith("trainable/")]
    index = {n: i for i, n in enumerate(names)}
    out = {}
    for key, v in read_sharded(path).items():
        kind, rest = key.split("/", 1)
        if kind == "optim":
            name, what = rest.rsplit("/", 1)
            out[f"opt/{index[name]}/{what}"] = v
        else:  # trainable/NAME, ema/NAME, extra/old/NAME -> old/NAME
            out[rest if kind == "extra" else key] = v
    return out


def assert_lora_loads(pipeline_dir: Path, lora_dir: Path, trained: dict) -> None:
    """`lora_dir` loads into a plain FluxPipeline with load_lora_weights and holds exactly `trained` (peft names)."""
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(pipeline_dir)
    pipe.load_lora_weights(lora_dir)
    state = pipe.transformer.state_dict()
    for k, v in trained.items():  # base_model.model.X.lora_A.default.weight -> X.lora_A.default_0.weight
        name = k[len("base_model.model."):].replace(".default.", ".default_0.")
        torch.testing.assert_close(state[name], v, rtol=0, atol=0, msg=name)  # exact: the saved tensors, loaded


def assert_same_runs(a: Path, b: Path, iteration: int = 3, floor=lambda key, row: 1e-7) -> None:
    """Every numeric metric of every row, the final evaluation and every checkpoint tensor at `iteration` agree
    (rtol 1e-5; a metric's absolute floor is `floor(key, row of a)`)."""
    ra, rb = rows(a), rows(b)
    assert [r["iteration"] for r in ra] == [r["iteration"] for r in rb] == list(range(1, iteration + 1))
    for x, y in zip(ra, rb):
        assert x.keys() == y.keys()
        for k, v in x.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                assert v == pytest.approx(y[k], rel=1e-5, abs=floor(k, x)), (x["iteration"], k, v, y[k])
    # the evaluation after training (EMA weights swapped into the shards, when on) agrees too
    ea, eb = (json.loads((d / "summary.json").read_text())["eval_after"] for d in (a, b))
    for k, v in ea.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            assert v == pytest.approx(eb[k], rel=1e-5, abs=1e-7), ("eval_after", k)
    ta, tb = checkpoint_tensors(a, iteration), checkpoint_tensors(b, iteration)
    assert ta.keys() == tb.keys() and any(k.startswith("opt/") for k in ta)
    for k in ta:
        torch.testing.assert_close(ta[k], tb[k], rtol=1e-5, atol=1e-7, msg=k)


@pytest.fixture(scope="module")
def tiny_flux(tmp_path_factory):
    pytest.importorskip("diffusers")
    from difrl.models.adapters import make_tiny_pipeline

    return make_tiny_pipeline("flux", tmp_path_factory.mktemp("fsdp") / "tiny_flux", seed=0)


def flux_args(path: Path, *extra: str) -> list[str]:
    return [str(ROOT / "configs" / "flux_tiny.yaml"), *FLUX, f"model.path={path}", *extra]


# ---------------------------------------------------------------------------------- end to end (2 processes)


# a's full fine-tuning: the KL to a frozen reference (sharded the same way) and EMA
FULL_KL_EMA = ("train.lora.enabled=false", "train.kl_beta=0.1", "train.ema_decay=0.9")


@pytest.fixture(scope="module")
def flux_launch(tiny_flux, tmp_path_factory):
    """The uninterrupted two-process runs of a, b and c in ONE launch (tests/many_runs.py: each run on a process group
    of its own, as a launch of its own would be; the launch's start-up, torch, diffusers and peft in 2 processes, is
    paid once): {name: (run dir, the launch output of that run alone)}. `accelerate launch --mixed_precision bf16`
    sets only ACCELERATE_MIXED_PRECISION=bf16 for its processes (accelerate/utils/launch.py), which the Accelerator
    reads at start: the bf16_mixed run gets it as its run's environment."""
    root = tmp_path_factory.mktemp("flux_launch")
    runs = {
        "full": (flux_args(tiny_flux, *FULL_KL_EMA, "train.grad_accum=2"), {}),
        # LoRA (the config's): the reference is the adapter switched off
        "lora": (flux_args(tiny_flux, "train.kl_beta=0.1", "train.grad_accum=2"), {}),
        "bf16_mixed": (flux_args(tiny_flux, "train.lora.enabled=false", "train.iterations=2", "train.grad_accum=2"),
                       {"ACCELERATE_MIXED_PRECISION": "bf16"}),
        "bf16_model": (flux_args(tiny_flux, "model.dtype=bf16", "train.lora.enabled=false", "train.iterations=2",
                                 "train.grad_accum=2", "train.ema_decay=0.9"), {}),
    }
    plan = [{"kind": "flux", "argv": [*a, "--out", str(root / name)], "env": e} for name, (a, e) in runs.items()]
    log = run(2, [str(ROOT / "tests" / "many_runs.py")], [json.dumps(plan)], root / "unused")  # --out: ignored
    # rank 0 prints its run's lines and then (flushed) "many_runs: run i/4 ..." to stdout, which comes first in `log`:
    # the text before the i-th of those lines and after the one before is run i's (stderr follows them all)
    parts = re.split(r"many_runs: run \d/4 on its own process group[^\n]*\n", log)
    assert len(parts) == 5, log[-3000:]
    for name, part in zip(runs, parts):  # each run's text holds its own sharding line, and only it
        assert part.count("difrl: FSDP2 over 2 processes") == 1, (name, part[-3000:])
    return {name: (root / name, part) for name, part in zip(runs, parts)}


@pytest.mark.slow  # a run of the launch flux_launch and two launches of the tiny FLUX pipeline
def test_fsdp_full_finetune_flux_equals_one_process_and_resumes_past_a_kill(tiny_flux, flux_launch, tmp_path):
    script = [str(ROOT / "scripts" / "train_flux.py")]
    args = flux_args(tiny_flux, *FULL_KL_EMA)
    one, (two, out), killed = tmp_path / "one", flux_launch["full"], tmp_path / "killed"
    run_here(script, [*args, "train.grad_accum=4"], one)
    assert "difrl: FSDP2 over 2 processes: 3 units (2 blocks of FluxSingleTransformerBlock, FluxTransformerBlock" in out
    assert "(the frozen reference sharded the same way)" in out
    assert_same_runs(one, two)
    # the base weights moved by far more than the tolerance (full fine-tuning: every weight is trainable)
    base = load_safetensors_checked(tiny_flux / "transformer" / "diffusion_pytorch_model.safetensors", "base")[0]
    trained = checkpoint_tensors(two, 3)
    assert set(base) == {k[len("trainable/"):] for k in trained if k.startswith("trainable/")}
    assert max(float((trained[f"trainable/{k}"] - v).abs().max()) for k, v in base.items()) > 1e-3

    # transformer/ is gathered (the EMA weights, as a single process saves it) and loads with plain diffusers
    from diffusers import FluxTransformer2DModel

    loaded = FluxTransformer2DModel.from_pretrained(two / "transformer").state_dict()
    assert loaded.keys() == base.keys()
    for k, v in loaded.items():
        torch.testing.assert_close(v, trained[f"ema/{k}"], rtol=0, atol=0, msg=k)  # exact: one gather, saved twice

    # SIGKILL after checkpoint 2, resume: the same rows and checkpoint as the run that was never stopped
    run_killed_after(2, script, [*args, "train.grad_accum=2"], killed, checkpoint=2)
    out = run(2, script, [*args, "train.grad_accum=2", f"resume={killed}"], killed)
    assert "resumed from" in out
    assert_same_runs(two, killed)


@pytest.mark.slow  # a run of the launch flux_launch
def test_fsdp_lora_flux_equals_one_process_and_loads_in_diffusers(tiny_flux, flux_launch, tmp_path):
    script = [str(ROOT / "scripts" / "train_flux.py")]
    args = flux_args(tiny_flux, "train.kl_beta=0.1")  # LoRA (the config's): the reference is the adapter switched off
    one, (two, out) = tmp_path / "one", flux_launch["lora"]
    run_here(script, [*args, "train.grad_accum=4"], one)
    assert "difrl: FSDP2 over 2 processes" in out
    assert_same_runs(one, two)
    trained = {k.split("/", 1)[1]: v for k, v in checkpoint_tensors(two, 3).items() if k.startswith("trainable/")}
    assert trained and all("lora_" in k for k in trained)
    assert max(float(v.abs().max()) for k, v in trained.items() if "lora_B" in k) > 1e-3  # B left zero

    # lora/ loads into a plain pipeline: its tensors are the gathered LoRA weights
    assert_lora_loads(tiny_flux, two / "lora", trained)


@pytest.mark.slow  # a run of the launch flux_launch
def test_fsdp_bf16_mixed_precision_from_the_accelerate_config(tiny_flux, flux_launch):
    # `accelerate launch --mixed_precision bf16` (or mixed_precision: bf16 in the config): the blocks compute in
    # bf16 in the rollout and in training alike (the first micro-step's ratio is exactly 1), the optimizer keeps
    # fp32 master weights (the checkpoint is fp32) and the weights move
    bf16, out = flux_launch["bf16_mixed"]
    assert "mixed precision bf16" in out
    assert [r["first_step_max_abs_log_ratio"] for r in rows(bf16)] == [0.0, 0.0]
    trained = checkpoint_tensors(bf16, 2)
    base = load_safetensors_checked(tiny_flux / "transformer" / "diffusion_pytorch_model.safetensors", "base")[0]
    assert all(v.dtype == torch.float32 for v in trained.values())
    assert max(float((trained[f"trainable/{k}"] - v).abs().max()) for k, v in base.items()) > 1e-3


@pytest.mark.slow  # a run of the launch flux_launch
def test_fsdp_bf16_model_full_finetune_keeps_fp32_masters(tiny_flux, flux_launch):
    # model.dtype=bf16 with full fine-tuning (difrl/train/precision.py): the transformer is upcast to fp32 before it is
    # sharded and FSDP2 gathers it in bf16 (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)) with no
    # --mixed_precision flag: ratio 1 on the first micro-step, every checkpointed tensor fp32, transformer/ in bf16
    bf16, out = flux_launch["bf16_model"]
    assert "mixed precision bf16" in out
    assert [r["first_step_max_abs_log_ratio"] for r in rows(bf16)] == [0.0, 0.0]
    trained = checkpoint_tensors(bf16, 2)
    assert {v.dtype for v in trained.values()} == {torch.float32} and any(k.startswith("ema/") for k in trained)
    base = load_safetensors_checked(tiny_flux / "transformer" / "diffusion_pytorch_model.safetensors", "base")[0]
    assert max(float((trained[f"trainable/{k}"] - v).abs().max()) for k, v in base.items()) > 1e-3
    written = load_safetensors_checked(bf16 / "transformer" / "diffusion_pytorch_model.safetensors", "t")[0]
    assert written.keys() == base.keys()
    for k, v in written.items():  # the EMA weights, gathered and written in the dtype the model was loaded in
        assert v.dtype == torch.bfloat16 and torch.equal(v, trained[f"ema/{k}"].bfloat16()), k  # exact: one cast


@pytest.mark.slow  # one launch of three digits runs, about 40 s on 2 cores
def test_fsdp_reshard_after_forward_off_and_cpu_offload_equal_the_default_run(tmp_path):
    # without full_tensors.reshard after each swap, reshard_after_forward=false differs from the first iteration on (NFT's
    # trained forward ran on the old policy's weights left gathered by its no-grad forward). The three runs share one
    # launch (tests/many_runs.py), each with the environment `accelerate launch --fsdp_reshard_after_forward false`
    # or `--fsdp_offload_params true` sets (the settings read from it: test_settings_come_from_the_accelerate_config)
    config = str(ROOT / "configs" / "digits_solrl.yaml")
    default, kept, offload = tmp_path / "default", tmp_path / "kept_gathered", tmp_path / "offload"
    plan = [{"argv": ["train", config, *DIGITS_NFT, "--out", str(d)], "env": e} for d, e in (
        (default, {}), (kept, {"FSDP_RESHARD_AFTER_FORWARD": "false"}), (offload, {"FSDP_OFFLOAD_PARAMS": "true"}))]
    out = run(2, [str(ROOT / "tests" / "many_runs.py")], [json.dumps(plan)], tmp_path / "unused")
    for i in (1, 2, 3):  # each run initialised a process group of its own, as a launch does (tests/many_runs.py)
        assert f"many_runs: run {i}/3 on its own process group (1 rendezvous under many_runs/{i - 1}/)" in out, i
    for said in ("mixed precision no;", "mixed precision no, kept gathered after forward;",
                 "mixed precision no, offloaded to the CPU;"):
        assert out.count(said) == 1, said
    assert any(k.startswith("old/") for k in checkpoint_tensors(default, 2))  # NFT's old policy is compared too
    for other in (kept, offload):
        assert_same_runs(default, other, iteration=2)


# ---------------------------------------------------------------------------------- fast checks


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(torch.nn.Module):
    """Two Blocks (FSDP units) and an output layer (the root unit)."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def test_settings_come_from_the_accelerate_config(monkeypatch):
    from types import SimpleNamespace

    from difrl.config import ConfigError
    from difrl.train.dist.sharding import fsdp_settings

    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert fsdp_settings(SimpleNamespace(mixed_precision="no")) is None  # not an FSDP launch
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", "false")
    monkeypatch.setenv("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP")
    monkeypatch.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", "BlockA,BlockB")
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")
    s = fsdp_settings(SimpleNamespace(mixed_precision="bf16"))
    assert (s.reshard_after_forward, s.offload_params, s.mixed_precision, s.block_classes) == (
        False, True, "bf16", ("BlockA", "BlockB"))
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ConfigError, match="FSDP2"):
        fsdp_settings(SimpleNamespace(mixed_precision="no"))


def test_block_classes_and_tied_weights():
    from torch import nn

    from difrl.models.adapters import BUILTIN_ADAPTERS
    from difrl.train.dist.sharding import block_modules

    import diffusers

    # each built-in adapter names block classes its transformer declares as unsplittable (every kind of the table,
    # registered ones too: tests/test_diffusers_models.py::test_block_classes_are_the_transformers_repeated_...)
    for kind, cls in BUILTIN_ADAPTERS.items():
        model_cls = {"flux": "FluxTransformer2DModel", "sd3": "SD3Transformer2DModel", "wan": "WanTransformer3DModel",
                     "sana": "SanaTransformer2DModel", "flux2": "Flux2Transformer2DModel",
                     "flux2_klein": "Flux2Transformer2DModel", "zimage": "ZImageTransformer2DModel",
                     "qwenimage": "QwenImageTransformer2DModel", "wan22": "WanTransformer3DModel",
                     "qwenimage_edit": "QwenImageTransformer2DModel"}[kind]
        assert set(cls.block_classes) <= set(getattr(diffusers, model_cls)._no_split_modules), kind

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(5, 4)
            self.fc = nn.Linear(4, 4)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = Block(), Block()
            self.out = nn.Linear(4, 5)
            self.out.weight = self.first.emb.weight  # tied: FSDP2 needs both uses in one unit

    net = Net()
    assert block_modules(net, ["Block"]) == [net.second]


def test_bench_fsdp_memory_halves_the_per_process_state(tmp_path):
    # benchmarks/bench_fsdp_memory.py --quick (one torchrun job of 2 processes; byte counts, no timings)
    import importlib.util

    pytest.importorskip("diffusers")
    spec = importlib.util.spec_from_file_location("bench_fsdp_memory", ROOT / "benchmarks" / "bench_fsdp_memory.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.main(["--quick", "--json", str(tmp_path / "rows.json")])
    assert json.loads((tmp_path / "rows.json").read_text()) == rows
    ddp, fsdp = rows[:2]
    # DDP: AdamW holds two moments per weight and the gradient one copy; FSDP2 holds about half of each
    assert ddp["params"] == ddp["grads"] > 0 and ddp["optimizer"] == pytest.approx(2 * ddp["params"], rel=1e-2)  # + steps
    # (bytes: 1% is room for the step counters, not rounding)
    for k in ("params", "grads", "optimizer", "total"):
        assert 0.45 < fsdp[k] / ddp[k] < 0.55, k
    # the rollout copy under FSDP2: a full copy per process as under DDP (the bench checks it equals the copy of the
    # gathered weights), built one gathered unit at a time: never the whole fp32 model at once
    ddp_copy, fsdp_copy = (r for r in rows if r["setting"].startswith("rollout copy"))
    assert fsdp_copy["copy_bytes"] == ddp_copy["copy_bytes"] > 0
    assert 0 < fsdp_copy["peak_gathered_bytes"] < fsdp_copy["model_fp32_bytes"]
    # a checkpoint save's peak host memory (VmHWM above VmRSS): gathered, rank 0 holds the full weights, EMA and
    # AdamW moments at once; sharded, no process holds more than a fraction of them
    sharded, gathered = (next(r for r in rows if r["setting"].startswith(f"checkpoint save, {f}"))
                         for f in ("sharded", "gathered"))
    full = gathered["state_full_bytes"]
    assert gathered["peak_rss_increase_rank0"] >= 0.9 * full
    assert sharded["peak_rss_increase_max"] < 0.5 * gathered["peak_rss_increase_rank0"]


def test_gather_copy_and_restore_in_one_process(tmp_path):
    # FSDP2 on a one-process gloo group, in this process: the DTensor code paths of sharding.py, full_tensors.py and
    # state.py.
    # A LoRA network, sharded per block, one update; gathered() shows the full weights, plain_copy() of them merges
    # LoRA into a plain module that computes what the sharded one computes; a checkpoint written from the shards
    # restores into a freshly sharded network (weights, EMA, AdamW moments) and the next update matches.
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model

    from difrl.train.dist.full_tensors import gathered, is_sharded, plain_copy
    from difrl.train.dist.sharding import FSDPSettings, shard
    from difrl.train.run.state import EMA, load_latest_checkpoint, restore_checkpoint, save_checkpoint, trainable_params

    def build():
        torch.manual_seed(0)
        net = get_peft_model(Net(), LoraConfig(r=2, target_modules=["fc1", "fc2"], init_lora_weights="gaussian"))
        net = shard(net, ["Block"], FSDPSettings())
        opt = torch.optim.AdamW(trainable_params(net).values(), lr=0.1)
        return net, opt, EMA(trainable_params(net), 0.5)

    def update(net, opt, ema, x):
        net(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ema.update()

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        net, opt, ema = build()
        assert all(is_sharded(p) for p in net.parameters())
        update(net, opt, ema, x)
        with torch.no_grad():
            y = net(x)
        with gathered(net):
            assert not any(is_sharded(p) for p in net.parameters())
            merged = plain_copy(net).merge_and_unload()
        assert type(merged) is Net and not any(is_sharded(p) for p in merged.parameters())
        torch.testing.assert_close(merged(x), y, **FP32_REORDER)  # W + s B A merged vs applied per forward: fp32
        assert all(is_sharded(p) for p in net.parameters())  # the shards are back
        save_checkpoint(tmp_path, 1, net, opt, ema, {})
        update(net, opt, ema, x)

        fresh, fopt, fema = build()
        restore_checkpoint(load_latest_checkpoint(tmp_path), fresh, fopt, fema)
        update(fresh, fopt, fema, x)
        for (k, p), q in zip(trainable_params(net).items(), trainable_params(fresh).values()):
            # exact: the checkpoint round trip is bitwise and the same update runs on the same values in one process
            torch.testing.assert_close(p.full_tensor(), q.full_tensor(), rtol=0, atol=0, msg=k)
            torch.testing.assert_close(ema.shadow[k].full_tensor(), fema.shadow[k].full_tensor(), rtol=0, atol=0, msg=k)
    finally:
        dist.destroy_process_group()


def test_shards_replaced_gives_each_sharded_parameter_one_replacement_and_puts_the_shards_back(one_process_group):
    # the one swap of shards for full tensors (gathered, the rollout copy's unit-wise gather and meta skeleton):
    # `full` is asked once, for the distinct sharded parameters in registration order (its collectives then run in
    # the same order on every process); a tied parameter gets one replacement on both owners; the shards are back
    # after the block, also when it raises; a list of modules swaps only their own parameters
    from difrl.train.dist.full_tensors import is_sharded, shards_replaced
    from difrl.train.dist.sharding import FSDPSettings, shard

    torch.manual_seed(0)
    base = Net()
    base.tied = torch.nn.Linear(8, 3)
    base.tied.weight = base.out.weight  # tied inside the root unit
    net = shard(base, ["Block"], FSDPSettings())
    shards = dict(net.named_parameters(remove_duplicate=False))
    assert net.tied.weight is net.out.weight and all(is_sharded(p) for p in shards.values())
    asked = []

    def full(params):
        asked.append([id(p) for p in params])
        return [torch.nn.Parameter(torch.full(p.shape, float(i)), requires_grad=False) for i, p in enumerate(params)]

    with shards_replaced(net.modules(), full):
        inside = dict(net.named_parameters(remove_duplicate=False))
        assert net.tied.weight is net.out.weight and not any(is_sharded(p) for p in inside.values())
        assert {k: tuple(p.shape) for k, p in inside.items()} == {k: tuple(p.shape) for k, p in shards.items()}
    assert asked == [[id(p) for p in net.parameters()]] and len(asked[0]) == len(set(map(id, shards.values())))
    assert all(p is shards[k] for k, p in net.named_parameters(remove_duplicate=False))
    with pytest.raises(RuntimeError, match="inside the block"):
        with shards_replaced(net.modules(), full):
            raise RuntimeError("inside the block")
    assert all(p is shards[k] for k, p in net.named_parameters(remove_duplicate=False))
    with shards_replaced([net.out], full):  # its own weight and bias; the tied owner keeps the shard
        assert not is_sharded(net.out.weight) and is_sharded(net.tied.weight) and is_sharded(net.blocks[0].fc1.weight)
    assert net.tied.weight is net.out.weight


def test_cpu_offload_needs_a_process_group_with_a_cpu_backend(monkeypatch):
    # offloaded shards and gradients are CPU tensors that gradient clipping and gather_to_host send through the process
    # group: on a GPU mesh the group needs a CPU backend next to NCCL, which refuses CPU tensors. A cuda:gloo group
    # is in the same position on this CPU machine (its only backend is for CUDA tensors): refused with the reason.
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    from difrl.config import ConfigError
    from difrl.train.dist.sharding import FSDPSettings, offload_policy, process_group_kwargs

    off = FSDPSettings(offload_params=True)
    assert type(offload_policy(FSDPSettings(), "cuda", None)) is OffloadPolicy  # no offload: the group is not consulted
    for backend, ok in (("cuda:gloo", False), ("cpu:gloo,cuda:gloo", True)):
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        try:
            if ok:
                assert offload_policy(off, "cuda", dist.group.WORLD).pin_memory  # pinned for asynchronous copies
            else:
                with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
                    dist.all_reduce(torch.ones(1))  # what NCCL answers for a CPU tensor
                with pytest.raises(ConfigError, match=r"fsdp_offload_params.*\(cuda:gloo\) have none for CPU"):
                    offload_policy(off, "cuda", dist.group.WORLD)
            policy = offload_policy(off, "cpu", dist.group.WORLD)  # CPU processes: no device, nothing to pin
            assert isinstance(policy, CPUOffloadPolicy) and not policy.pin_memory
        finally:
            dist.destroy_process_group()
    # the Accelerator is asked for both backends when an FSDP launch on GPUs offloads, and only then
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")
    assert [h.backend for h in process_group_kwargs(cpu=False)] == ["cuda:nccl,cpu:gloo"]
    assert process_group_kwargs(cpu=True) == []
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "false")
    assert process_group_kwargs(cpu=False) == []


SWAP_DRIVER = """import sys
sys.path.insert(0, {tests!r})
from test_fsdp import swap_and_restore_worker
swap_and_restore_worker(sys.argv[1])
"""


def swap_and_restore_worker(out: str) -> None:
    """One process of the torchrun job of test_a_forward_after_a_swap_or_a_restore_uses_the_written_weights: Net
    sharded with reshard_after_forward=False (without, then with CPU offload), one AdamW update, then forwards after
    an EMA swap, a swap back and a checkpoint restore, each right after a forward that left the units gathered. Writes
    the outputs and the full weights they should have used (OUT/rank{r}-offload{0|1}.safetensors)."""
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model

    from difrl.train.scaffold import adapter_disabled
    from difrl.train.dist.full_tensors import gather_to_host, is_sharded, reshard
    from difrl.train.dist.sharding import FSDPSettings, shard
    from difrl.train.run.state import EMA, load_latest_checkpoint, restore_checkpoint, snapshot, trainable_params, write_checkpoint
    from difrl.utils.io import save_safetensors

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, out = dist.get_rank(), Path(out)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    for offload in (0, 1):
        torch.manual_seed(0)
        net = shard(Net(), ["Block"], FSDPSettings(reshard_after_forward=False, offload_params=bool(offload)))
        params = trainable_params(net)
        opt = torch.optim.AdamW(params.values(), lr=0.1)
        ema = EMA(params, 0.5, net)

        def update():
            net(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            ema.update()

        update()  # the live weights move away from the EMA's
        saved = {}
        with torch.no_grad():
            saved["live_y"] = net(x)
            # what full_tensors.reshard is for: the forward left its gathered weights registered in place of the shards
            assert not any(is_sharded(p) for p in net.parameters())
            with ema.swapped():
                saved["ema_y"] = net(x)
            saved["back_y"] = net(x)
        saved |= {f"live/{k}": gather_to_host(p) for k, p in params.items()}
        saved |= {f"ema/{k}": gather_to_host(v) for k, v in ema.shadow.items()}
        run_dir = out / f"run-offload{offload}"
        snap = snapshot(net, opt, ema, keep=True)  # every process (collective) keeps it here; rank 0 writes
        if rank == 0:
            write_checkpoint(run_dir, 1, snap, {})
        dist.barrier()
        saved |= {f"checkpoint/{k}": v for k, v in snap.trainable.items()}
        update()
        with torch.no_grad():
            net(x)  # gathered: the weights of the second update
        restore_checkpoint(load_latest_checkpoint(run_dir), net, opt, ema)
        with torch.no_grad():
            saved["restored_y"] = net(x)
        reshard(net)
        assert all(is_sharded(p) for p in net.parameters())
        save_safetensors({k: v.detach().contiguous() for k, v in saved.items()}, out / f"rank{rank}-offload{offload}.safetensors")
    # the reference policy under LoRA (peft switches the adapter's requires_grad off and on around a forward that
    # leaves the units gathered) leaves the shards trainable
    torch.manual_seed(0)
    lora = get_peft_model(Net(), LoraConfig(r=2, target_modules=["fc1", "fc2"]))
    lora = shard(lora, ["Block"], FSDPSettings(reshard_after_forward=False))
    names = set(trainable_params(lora))
    with torch.no_grad(), adapter_disabled(lora):
        lora(x)
    reshard(lora)
    assert names and set(trainable_params(lora)) == names, sorted(trainable_params(lora))
    dist.barrier()
    dist.destroy_process_group()


def test_a_forward_after_a_swap_or_a_restore_uses_the_written_weights(tmp_path):
    # fsdp_reshard_after_forward: false on 2 processes: each forward computes what one plain process computes with
    # the weights last written (live, EMA, live again, restored), also with CPU offload; the checkpoint written
    # while the units were gathered holds the trained weights; LoRA's reference switch leaves the shards trainable
    run_driver(SWAP_DRIVER, tmp_path, timeout=300)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    plain = Net()
    for rank in (0, 1):
        for offload in (0, 1):
            got = load_safetensors_checked(tmp_path / f"rank{rank}-offload{offload}.safetensors", "outputs")[0]

            def weights(prefix):
                return {k[len(prefix):]: v for k, v in got.items() if k.startswith(prefix)}

            assert weights("live/").keys() == weights("ema/").keys() == weights("checkpoint/").keys() == plain.state_dict().keys()
            for k, v in weights("checkpoint/").items():
                torch.testing.assert_close(v, got[f"live/{k}"], rtol=0, atol=0, msg=k)  # exact: the same weights saved
            plain.load_state_dict(weights("live/"))
            with torch.no_grad():
                live_y = plain(x)
            plain.load_state_dict(weights("ema/"))
            with torch.no_grad():
                ema_y = plain(x)
            assert float((live_y - ema_y).abs().max()) > 1e-3  # the swap changes what the network computes
            for name, want in (("live_y", live_y), ("ema_y", ema_y), ("back_y", live_y), ("restored_y", live_y)):
                # a sharded module's forward in another process against a plain one here: fp32, maybe another kernel
                torch.testing.assert_close(got[name], want, **FP32_REORDER,
                                           msg=f"rank {rank}, offload {offload}: {name}")

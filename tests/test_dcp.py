"""Sharded checkpoints (torch.distributed.checkpoint, difrl/train/run/sharded_state.py) and `difrl export`.

    HF_HUB_OFFLINE=1 python -m pytest tests/test_dcp.py -q            # the end-to-end ones are marked slow

a. Fast, in this process (a one-process gloo group, the network sharded per block): a sharded checkpoint holds DCP's
   .metadata and __0_0.distcp beside rng / state / manifest; it restores the weights, EMA, an extra EMA
   (DiffusionNFT's old policy) and AdamW's moments, also into an unsharded network; the manifest catches a damaged
   and a missing DCP file (resume falls back to the previous checkpoint, naming the file); a save killed half way
   (DCP's files written, its .metadata not) leaves no checkpoint that resume would pick; `keep` prunes.
b. Slow, tiny FLUX full fine-tuning with EMA (tests/test_fsdp.py's launch helpers): a 2-process FSDP run killed by
   SIGKILL after its second checkpoint and resumed on 1 plain process, and a 1-process run with sharded checkpoints
   killed after its first and resumed on 2 FSDP processes, both equal the uninterrupted 2-process run (every metric
   row, the final evaluation, checkpoint 3's weights, EMA and AdamW moments, transformer/: rtol 1e-5).
   `difrl export` of the uninterrupted run's last sharded checkpoint writes the transformer/ the run wrote
   (FluxTransformer2DModel.from_pretrained, the EMA weights); of a LoRA run's, a lora/ that load_lora_weights reads.
c. Slow, digits in this process (one plain process with train.checkpoint_format=sharded): the exported
   policy.safetensors is the one the run wrote at the end; a damaged checkpoint is refused naming the file.
The peak host memory of a save (gathered vs sharded) is benchmarks/bench_fsdp_memory.py's, checked by
tests/test_fsdp.py::test_bench_fsdp_memory_halves_the_per_process_state.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from test_fsdp import (ROOT, Net, assert_lora_loads, assert_same_runs, flux_args, run,  # noqa: F401
                       run_here, run_killed_after, tiny_flux)


# ---------------------------------------------------------------------------------- fast checks (one process)


def build(sharded: bool = True):
    from difrl.train.dist.sharding import FSDPSettings, shard
    from difrl.train.run.state import EMA, trainable_params

    torch.manual_seed(0)
    net = Net()
    if sharded:
        net = shard(net, ["Block"], FSDPSettings())
    params = trainable_params(net)
    return net, torch.optim.AdamW(params.values(), lr=0.1), EMA(params, 0.5, net), {"old": EMA(params, 0.0, net)}


def update(net, opt, ema, extras, x):
    net(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    ema.update()
    extras["old"].update(0.3)


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def save(run_dir, it, net, opt, ema, extras):
    from difrl.train.run.state import save_sharded

    return save_sharded(run_dir, it, net, opt, ema, extras, {"best_fd": None}, True, lambda: None)


def test_sharded_checkpoint_restores_into_any_layout(tmp_path, one_process_group):
    from difrl.train.run.state import load_latest_checkpoint, restore_checkpoint, trainable_params

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    net, opt, ema, extras = build()
    update(net, opt, ema, extras, x)
    path = save(tmp_path, 1, net, opt, ema, extras)
    assert {p.name for p in path.iterdir()} == {".metadata", "__0_0.distcp", "rng.safetensors", "state.json",
                                                "manifest.json"}
    assert {".metadata", "__0_0.distcp"} <= set(json.loads((path / "manifest.json").read_text())["files"])
    for sharded in (True, False):  # into a freshly sharded network, and into a plain one (the whole tensors)
        fresh, fopt, fema, fextras = build(sharded)
        update(fresh, fopt, fema, fextras, x + 1)  # moved away: restore must overwrite all of it
        restore_checkpoint(load_latest_checkpoint(tmp_path), fresh, fopt, fema, fextras)
        assert (fema.num_updates, fextras["old"].num_updates) == (ema.num_updates, 1)
        live, got = trainable_params(net), trainable_params(fresh)
        for k, p in live.items():  # exact: a save and load moves bits, whatever the layout
            torch.testing.assert_close(full(got[k]), full(p), rtol=0, atol=0, msg=k)
            torch.testing.assert_close(full(fema.shadow[k]), full(ema.shadow[k]), rtol=0, atol=0, msg=k)
            torch.testing.assert_close(full(fextras["old"].shadow[k]), full(extras["old"].shadow[k]), rtol=0, atol=0)
            for m in ("exp_avg", "exp_avg_sq", "step"):
                torch.testing.assert_close(full(fopt.state[got[k]][m]), full(opt.state[p][m]), rtol=0, atol=0)
        # the next update from the restored state is the one the live network makes
        update(fresh, fopt, fema, fextras, x)
        if sharded:
            n2, o2, e2, x2 = build()
            restore_checkpoint(load_latest_checkpoint(tmp_path), n2, o2, e2, x2)
            update(n2, o2, e2, x2, x)
            for k, p in trainable_params(n2).items():
                # exact: the same restored state, the same update on the same numbers in this process
                torch.testing.assert_close(full(trainable_params(fresh)[k]), full(p), rtol=0, atol=0, msg=k)
    # another model (a LoRA setting, another network) is refused naming what differs
    other, oopt, _, _ = build(sharded=False)
    other.out = torch.nn.Linear(8, 4)
    with pytest.raises(ValueError, match=r"does not match this model: out\.weight is \[3, 8\] in the checkpoint, \[4"):
        restore_checkpoint(load_latest_checkpoint(tmp_path), other, torch.optim.AdamW(other.parameters()), None)


def test_manifest_catches_damaged_and_missing_shard_files_and_a_killed_save_leaves_none(tmp_path, monkeypatch,
                                                                                        one_process_group):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from difrl.train.run.state import CheckpointError, checkpoint_dirs, load_latest_checkpoint, verify_manifest

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    net, opt, ema, extras = build()
    for it in (1, 2, 3):
        update(net, opt, ema, extras, x)
        save(tmp_path, it, net, opt, ema, extras)
    root = tmp_path / "checkpoints"
    assert [p.name for p in checkpoint_dirs(root)] == ["iter-000003", "iter-000002"]  # keep=2 pruned iter-000001

    # a damaged shard file: the manifest names it, resume falls back to the previous checkpoint
    shard = root / "iter-000003" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"iter-000003.*__0_0\.distcp does not match its SHA-256"):
        verify_manifest(root / "iter-000003")
    said = []
    assert load_latest_checkpoint(tmp_path, said.append).iteration == 2
    assert any("__0_0.distcp" in s and "trying the previous checkpoint" in s for s in said)
    # a missing .metadata: named; with both damaged the run refuses to start again from scratch
    (root / "iter-000002" / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"\.metadata is missing"):
        verify_manifest(root / "iter-000002")
    with pytest.raises(CheckpointError, match="every checkpoint .* is damaged"):
        load_latest_checkpoint(tmp_path, said.append)
    # unverified (no manifest) and a garbage .metadata: an error naming the file, not a pickle traceback
    (root / "iter-000002" / "manifest.json").unlink()
    (root / "iter-000002" / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match=r"iter-000002/\.metadata is missing or corrupted"):
        load_latest_checkpoint(tmp_path, said.append, allow_unverified=True)

    # a save killed half way (every process's shards written, DCP's .metadata not, no manifest, no rename): resume
    # picks the previous checkpoint, and the next save of that iteration replaces the leftover
    run = tmp_path / "killed"
    save(run, 1, net, opt, ema, extras)

    def killed(self, *a, **k):
        raise RuntimeError("killed mid-save")

    with monkeypatch.context() as m:
        m.setattr(dcp.FileSystemWriter, "finish", killed)
        with pytest.raises(CheckpointException, match="ranks"):  # DCP wraps it (a BaseException)
            save(run, 2, net, opt, ema, extras)
    left = run / "checkpoints" / ".tmp-iter-000002"
    assert (left / "__0_0.distcp").exists() and not (left / ".metadata").exists()
    assert [p.name for p in checkpoint_dirs(run / "checkpoints")] == ["iter-000001"]
    assert load_latest_checkpoint(run).iteration == 1
    save(run, 2, net, opt, ema, extras)
    assert load_latest_checkpoint(run).iteration == 2 and not left.exists()


def test_checkpoint_format_is_the_runs_own_on_resume(tmp_path):
    # auto resolves to sharded under FSDP, gathered otherwise; a resumed run keeps what its config.yaml recorded
    # (auto on the command line is no change), and naming the other format is refused like any algorithm key
    from difrl.config import ConfigError
    from difrl.train.config import load_flow_config
    from difrl.train.run.rundir import check_resume
    from difrl.train.run.sharded_state import checkpoint_format

    digits = ROOT / "configs" / "digits.yaml"
    cfg = load_flow_config(digits, [])
    assert (checkpoint_format(cfg, tmp_path, True), checkpoint_format(cfg, tmp_path, False)) == ("sharded", "gathered")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    from difrl.config import save_config

    save_config(load_flow_config(digits, ["train.checkpoint_format=sharded"]), run_dir / "config.yaml")
    resumed = load_flow_config(digits, [f"resume={run_dir}"])
    assert check_resume(resumed, run_dir) == []
    assert checkpoint_format(resumed, run_dir, sharded=False) == "sharded"  # one plain process keeps DCP
    with pytest.raises(ConfigError, match="train.checkpoint_format=sharded in .* gathered"):
        check_resume(load_flow_config(digits, [f"resume={run_dir}", "train.checkpoint_format=gathered"]), run_dir)


# ---------------------------------------------------------------------------------- end to end (tiny FLUX)

SCRIPT = [str(ROOT / "scripts" / "train_flux.py")]
# full fine-tuning with EMA; micro_batch=auto: each process's samples in grad_accum micro-batches, so 1 process and
# 2 processes take the same config (a resume cannot change train.* keys) and the same global batch per update
FULL = ("train.lora.enabled=false", "train.ema_decay=0.9", "train.micro_batch=auto", "train.grad_accum=2")


@pytest.fixture(scope="module")
def uninterrupted(tiny_flux, tmp_path_factory):
    """The reference: 2 FSDP processes, 3 iterations, sharded checkpoints (the default under FSDP)."""
    out = tmp_path_factory.mktemp("dcp") / "uninterrupted"
    assert "difrl: FSDP2 over 2 processes" in run(2, SCRIPT, flux_args(tiny_flux, *FULL), out)
    return out


def assert_same_weights(a: Path, b: Path) -> None:
    from difrl.utils.io import load_safetensors_checked

    f = "transformer/diffusion_pytorch_model.safetensors"
    wa, wb = (load_safetensors_checked(d / f, "transformer")[0] for d in (a, b))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-7, msg=k)  # 1 vs 2 processes: fp32 sums reordered


@pytest.mark.slow  # three launches of the tiny FLUX pipeline, a run in this process (+ the shared 2-process reference)
def test_sharded_run_resumes_on_another_number_of_processes(uninterrupted, tiny_flux, tmp_path):
    from difrl.config import load_config
    from difrl.train.config import FlowConfig

    args = flux_args(tiny_flux, *FULL)
    assert (uninterrupted / "checkpoints" / "iter-000003" / "__1_0.distcp").exists()  # each process wrote its shards
    # 2 -> 1: SIGKILL (launcher and both processes) after checkpoint 2, resumed by one plain process
    two_one = tmp_path / "two_one"
    run_killed_after(2, SCRIPT, args, two_one, checkpoint=2)
    # the one plain process in this test process (run_here: the script's code without a second start-up of torch,
    # diffusers and peft; no process group, as in a process of its own)
    out = run_here(SCRIPT, [*args, f"resume={two_one}"], two_one)
    assert "resumed from" in out
    # the run kept its format: config.yaml says sharded, and the one process wrote DCP files too
    assert load_config(FlowConfig, two_one / "config.yaml").train.checkpoint_format == "sharded"
    assert (two_one / "checkpoints" / "iter-000003" / ".metadata").exists()
    assert_same_runs(uninterrupted, two_one)
    assert_same_weights(uninterrupted, two_one)

    # 1 -> 2: one plain process writing sharded checkpoints, killed after checkpoint 1, resumed on 2 FSDP processes
    one_two = tmp_path / "one_two"
    run_killed_after(1, SCRIPT, [*args, "train.checkpoint_format=sharded"], one_two, checkpoint=1)
    assert not (one_two / "checkpoints" / "iter-000001" / "__1_0.distcp").exists()
    out = run(2, SCRIPT, [*args, "train.checkpoint_format=sharded", f"resume={one_two}"], one_two)
    assert "resumed from" in out and "difrl: FSDP2 over 2 processes" in out
    assert_same_runs(uninterrupted, one_two)
    assert_same_weights(uninterrupted, one_two)


def export(capsys, run_dir: Path, *extra: str) -> Path:
    """`difrl export RUN_DIR ...` (the CLI, in this process): the directory it wrote."""
    from difrl.cli import main

    capsys.readouterr()
    assert main(["export", str(run_dir), *extra]) == 0
    return Path(capsys.readouterr().out.strip().splitlines()[-1].rsplit(" -> ", 1)[1].split(", ")[0]).parent


@pytest.mark.slow  # one 1-process run of the tiny FLUX pipeline (in this process) and three exports
def test_export_writes_plain_diffusers_files(uninterrupted, tiny_flux, tmp_path, capsys):
    from diffusers import FluxTransformer2DModel

    from difrl.cli import main
    from difrl.train.run.sharded_state import read_sharded

    # full fine-tuning: transformer/ of the last checkpoint is the EMA weights, the file the run itself wrote
    out = export(capsys, uninterrupted)
    assert out == uninterrupted / "export" / "iter-000003"
    ema = {k[len("ema/"):]: v for k, v in read_sharded(uninterrupted / "checkpoints" / "iter-000003", "ema/").items()}
    loaded = FluxTransformer2DModel.from_pretrained(out / "transformer").state_dict()
    assert loaded.keys() == ema.keys()
    for k, v in loaded.items():
        torch.testing.assert_close(v, ema[k], rtol=0, atol=0, msg=k)  # exact: the checkpoint's tensors, rewritten
    assert_same_weights(uninterrupted, out)
    # an older checkpoint by --iteration, into --out; a non-empty --out is refused
    older = export(capsys, uninterrupted, "--iteration", "2", "--out", str(tmp_path / "iter2"))
    assert older == tmp_path / "iter2"
    assert main(["export", str(uninterrupted), "--out", str(older)]) == 2
    assert "is not empty" in capsys.readouterr().err

    # LoRA (one process, sharded checkpoints asked for): lora/ loads into a plain pipeline, equal to the checkpoint
    lora = tmp_path / "lora"
    # the one plain process in this test process (run_here: no second start-up of torch and diffusers)
    run_here(SCRIPT, flux_args(tiny_flux, "train.iterations=1", "train.grad_accum=4",
                               "train.checkpoint_format=sharded"), lora)
    out = export(capsys, lora)
    trained = {k[len("trainable/"):]: v
               for k, v in read_sharded(lora / "checkpoints" / "iter-000001", "trainable/").items()}
    assert trained and all("lora_" in k for k in trained)
    assert_lora_loads(tiny_flux, out / "lora", trained)


@pytest.mark.slow  # one tiny digits run in this process, about 30 s on 2 busy cores
def test_export_of_a_bundled_world_is_its_final_policy(tmp_path, capsys):
    # digits (one plain process, sharded checkpoints asked for, EMA on): policy.safetensors exported from the last
    # checkpoint is the file the run wrote at the end (the EMA weights, LoRA merged); a damaged checkpoint is named
    from test_train import run as train_digits

    from difrl.cli import main
    from difrl.utils.io import load_safetensors_checked

    _, run_dir = train_digits(tmp_path / "digits", "train.checkpoint_format=sharded", "train.ema_decay=0.5")
    assert (run_dir / "checkpoints" / "iter-000001" / ".metadata").exists()
    out = export(capsys, run_dir)
    mine, theirs = (load_safetensors_checked(d / "policy.safetensors", "policy") for d in (out, run_dir))
    assert mine[0].keys() == theirs[0].keys() and mine[1] == theirs[1]
    for k, v in mine[0].items():  # exact: the same tensors written by two paths
        assert torch.equal(v, theirs[0][k]), k
    (run_dir / "checkpoints" / "iter-000001" / "__0_0.distcp").write_bytes(b"garbage")
    assert main(["export", str(run_dir), "--iteration", "1", "--out", str(tmp_path / "x")]) == 2
    assert "__0_0.distcp has 7 bytes" in capsys.readouterr().err


def test_export_of_a_masked_run_is_its_final_save(tmp_path, capsys):
    # Sudoku with LoRA (one plain process): the export of the last checkpoint writes the files the run wrote at the
    # end (final_save.save_final, one path for both): policy.safetensors (LoRA merged) and peft's lora/
    from test_train_masked import run as train_sudoku

    from difrl.utils.io import load_safetensors_checked

    _, run_dir = train_sudoku(tmp_path / "sudoku", "train.lora.enabled=true", "train.lora.rank=2")
    out = export(capsys, run_dir)
    assert out == run_dir / "export" / "iter-000001"
    assert sorted(p.name for p in out.iterdir()) == ["lora", "policy.safetensors"]
    assert sorted(p.name for p in (out / "lora").iterdir()) == sorted(p.name for p in (run_dir / "lora").iterdir())
    for name in ("policy.safetensors", "lora/adapter_model.safetensors"):
        mine, theirs = (load_safetensors_checked(d / name, name) for d in (out, run_dir))
        assert mine[0].keys() == theirs[0].keys() and mine[1] == theirs[1], name
        for k, v in mine[0].items():  # exact: the same tensors written by two paths
            assert torch.equal(v, theirs[0][k]), (name, k)

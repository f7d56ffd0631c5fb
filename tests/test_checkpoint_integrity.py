"""Checkpoint integrity: a manifest (size + SHA-256 of every file) written with each checkpoint, verified on
resume, and a fall back to the newest intact checkpoint when the newest is damaged.

    .venv/bin/python -m pytest tests/test_checkpoint_integrity.py -q
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from difrl.train.run.state import EMA, CheckpointError, load_latest_checkpoint, restore_checkpoint, save_checkpoint

# ------------------------------------------------------------------------- damage, as found in the wild


def flip_data_bytes(path: Path, n: int = 64) -> None:
    """Invert n bytes in the middle of a safetensors file's tensor data (its JSON header stays valid)."""
    raw = bytearray(path.read_bytes())
    data_start = 8 + struct.unpack("<Q", raw[:8])[0]
    assert len(raw) - data_start >= n, "file too small to flip its data"
    lo = data_start + (len(raw) - data_start - n) // 2
    raw[lo:lo + n] = bytes(b ^ 0xFF for b in raw[lo:lo + n])
    path.write_bytes(bytes(raw))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
    "flip rng.safetensors data": lambda d: flip_data_bytes(d / "rng.safetensors"),
    "flip trainable.safetensors data": lambda d: flip_data_bytes(d / "trainable.safetensors", 8),
    "truncate optimizer.pt": lambda d: truncate(d / "optimizer.pt"),
    "delete ema.safetensors": lambda d: (d / "ema.safetensors").unlink(),
    "garbage state.json": lambda d: (d / "state.json").write_text('{"iteration": "x"'),
    "garbage manifest.json": lambda d: (d / "manifest.json").write_text("[1, 2"),
    "foreign file added": lambda d: (d / "evil.safetensors").write_bytes(b"\0" * 16),
    "deleted manifest.json": lambda d: (d / "manifest.json").unlink(),  # unverifiable: damaged unless allowed
}
NAMED = {"flip rng.safetensors data": "rng.safetensors", "flip trainable.safetensors data": "trainable.safetensors",
         "truncate optimizer.pt": "optimizer.pt", "delete ema.safetensors": "ema.safetensors",
         "garbage state.json": "state.json", "garbage manifest.json": "manifest.json",
         "foreign file added": "evil.safetensors", "deleted manifest.json": "manifest.json"}


def tiny_training(run_dir: Path, iterations: int, keep: int = 2):
    """A Linear layer trained by AdamW with an EMA, checkpointed after every step; returns (module, opt, ema)."""
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    ema = EMA(dict(net.named_parameters()), 0.5)
    for it in range(1, iterations + 1):
        net(torch.full((2, 4), float(it))).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        ema.update()
        save_checkpoint(run_dir, it, net, opt, ema, {"note": f"after {it}"}, keep=keep)
    return net, opt, ema


# ------------------------------------------------------------------------- unit level


def test_manifest_lists_every_file_and_only_two_checkpoints_are_kept(tmp_path):
    tiny_training(tmp_path, 4, keep=1)  # keep=1 is raised to 2: the previous checkpoint is the fall back
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["iter-000003", "iter-000004", "latest"]
    manifest = json.loads((root / "iter-000004" / "manifest.json").read_text())["files"]
    files = sorted(p.name for p in (root / "iter-000004").iterdir() if p.name != "manifest.json")
    assert sorted(manifest) == files == ["ema.safetensors", "optimizer.pt", "rng.safetensors", "state.json",
                                         "trainable.safetensors"]
    for name, entry in manifest.items():
        assert entry["bytes"] == (root / "iter-000004" / name).stat().st_size
        assert len(entry["sha256"]) == 64


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, damage):
    net, opt, ema = tiny_training(tmp_path, 3)
    root = tmp_path / "checkpoints"
    intact = load_latest_checkpoint(tmp_path, log=lambda s: None)
    assert intact.iteration == 3
    DAMAGE[damage](root / "iter-000003")
    said = []
    ckpt = load_latest_checkpoint(tmp_path, log=said.append)
    assert ckpt.iteration == 2 and ckpt.path.name == "iter-000002"
    text = "\n".join(said)
    assert "iter-000003" in text and NAMED[damage] in text and "resuming from iter-000002" in text
    # what loads is exactly what iteration 2 saved: restore it into a fresh model
    torch.manual_seed(1)
    fresh = torch.nn.Linear(4, 3)
    fopt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    fema = EMA(dict(fresh.named_parameters()), 0.5)
    restore_checkpoint(ckpt, fresh, fopt, fema)
    assert ckpt.state["note"] == "after 2" and fema.num_updates == 2
    assert not torch.equal(fresh.weight, net.weight)  # the iteration-3 weights are not what loaded
    # a damaged newest checkpoint is replaced when the run saves that iteration again
    save_checkpoint(tmp_path, 3, fresh, fopt, fema, {"note": "redone"})
    assert load_latest_checkpoint(tmp_path, log=said.append).state["note"] == "redone"


def test_after_a_fall_back_the_damaged_newer_checkpoint_is_not_kept(tmp_path):
    # checkpoint_every=0 style: the resumed run's next save is far past the damaged one; the two kept must be
    # that save and the intact one it resumed from, not the damaged one
    net, opt, ema = tiny_training(tmp_path, 3)
    root = tmp_path / "checkpoints"
    flip_data_bytes(root / "iter-000003" / "trainable.safetensors", 8)
    assert load_latest_checkpoint(tmp_path, log=lambda s: None).iteration == 2
    save_checkpoint(tmp_path, 2, net, opt, ema, {"note": "resaved"})  # a stop right after resuming
    assert sorted(p.name for p in root.glob("iter-*")) == ["iter-000002"]  # iter-000001 went when 3 was saved
    save_checkpoint(tmp_path, 9, net, opt, ema, {"note": "later"})
    assert sorted(p.name for p in root.glob("iter-*")) == ["iter-000002", "iter-000009"]
    assert not list(root.glob(".old-*")) and not list(root.glob(".tmp-*"))


def test_truncated_file_and_deleted_file_are_named(tmp_path):
    tiny_training(tmp_path, 2)
    d = tmp_path / "checkpoints" / "iter-000002"
    truncate(d / "trainable.safetensors")
    (d / "rng.safetensors").unlink()
    said = []
    assert load_latest_checkpoint(tmp_path, log=said.append).iteration == 1
    assert "trainable.safetensors has" in said[0] and "truncated" in said[0] and "rng.safetensors is missing" in said[0]


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start(tmp_path):
    tiny_training(tmp_path, 2)
    for it in (1, 2):
        flip_data_bytes(tmp_path / "checkpoints" / f"iter-{it:06d}" / "trainable.safetensors", 4)
    with pytest.raises(CheckpointError, match=r"every checkpoint .* is damaged.*iter-000002.*trainable.safetensors"
                                              r".*iter-000001.*trainable.safetensors"):
        load_latest_checkpoint(tmp_path, log=lambda s: None)


def test_latest_pointer_damaged_or_dangling(tmp_path):
    tiny_training(tmp_path, 2)
    root = tmp_path / "checkpoints"
    (root / "latest").write_bytes(b"\xff\xfe garbage")
    said = []
    assert load_latest_checkpoint(tmp_path, log=said.append).iteration == 2
    assert "not a checkpoint" in said[0]
    for p in root.glob("iter-*"):
        import shutil

        shutil.rmtree(p)
    with pytest.raises(CheckpointError, match="holds no checkpoint directory"):
        load_latest_checkpoint(tmp_path, log=said.append)


def test_checkpoint_without_manifest_is_damaged_unless_the_user_allows_it(tmp_path):
    # a deleted manifest and one never written look the same: by default neither loads unchecked
    tiny_training(tmp_path, 2)
    root = tmp_path / "checkpoints"
    for it in (1, 2):
        (root / f"iter-{it:06d}" / "manifest.json").unlink()
    said = []
    with pytest.raises(CheckpointError, match=r"every checkpoint .* is damaged.*iter-000002.*manifest.json is missing"
                                              r".*resume_unverified=true"):
        load_latest_checkpoint(tmp_path, log=said.append)
    assert "iter-000002" in said[0] and "manifest.json is missing" in said[0]
    # the explicit flag: the newest loads with a warning, and a file that does not parse still falls back
    said.clear()
    assert load_latest_checkpoint(tmp_path, log=said.append, allow_unverified=True).iteration == 2
    assert "no manifest.json" in said[0] and "resume_unverified=true" in said[0]
    (root / "iter-000002" / "optimizer.pt").write_bytes(b"garbage")
    said.clear()
    assert load_latest_checkpoint(tmp_path, log=said.append, allow_unverified=True).iteration == 1
    assert "optimizer.pt" in said[0] and "iter-000002" in said[0]


def test_resume_unverified_is_the_config_key_a_trainer_passes(tmp_path, capsys):
    # Run.open (every trainer's resume) falls back past a manifest-less checkpoint unless resume_unverified=true
    from difrl.train.config import load_flow_config
    from difrl.train.scaffold import Run

    tiny_training(tmp_path, 2)
    (tmp_path / "checkpoints" / "iter-000002" / "manifest.json").unlink()

    def resume(*overrides):
        torch.manual_seed(1)
        net = torch.nn.Linear(4, 3)
        opt = torch.optim.AdamW(net.parameters(), lr=0.1)
        return Run.open(load_flow_config(None, [f"resume={tmp_path}", *overrides]), tmp_path, net, opt,
                        EMA(dict(net.named_parameters()), 0.5)).start

    assert resume() == 1
    assert "manifest.json is missing" in capsys.readouterr().out
    assert resume("resume_unverified=true") == 2
    assert "no manifest.json and resume_unverified=true" in capsys.readouterr().out


def test_no_checkpoints_is_none(tmp_path):
    assert load_latest_checkpoint(tmp_path) is None
    (tmp_path / "checkpoints" / ".tmp-iter-000001").mkdir(parents=True)  # a write killed before its rename
    assert load_latest_checkpoint(tmp_path) is None


# ------------------------------------------------------------------------- end to end (digits world)

TINY = [
    "seed=3", "sampler.num_steps=4", "rollout.prompts_per_iter=2", "rollout.group_size=4",
    "train.micro_batch=6", "train.grad_accum=2", "train.lr=1e-3", "eval.every=0", "eval.per_digit=3",
    "eval.num_steps=3", "checkpoint_every=1", "train.ema_decay=0.7", "train.kl_beta=0.1",
]


@pytest.mark.slow  # three tiny training runs, ~10 s
def test_resume_past_a_damaged_checkpoint_is_bit_identical(tmp_path, capsys):
    from difrl.train.config import load_flow_config
    from difrl.train.flow.trainer import TIMING_KEYS, train
    from difrl.utils.io import load_safetensors_checked

    def rows(d):
        return [{k: v for k, v in json.loads(ln).items() if k not in TIMING_KEYS}
                for ln in (d / "metrics.jsonl").read_text().splitlines()]

    full, part = tmp_path / "full", tmp_path / "part"
    train(load_flow_config(None, [*TINY, "train.iterations=4"]), out_dir=full)
    train(load_flow_config(None, [*TINY, "train.iterations=3"]), out_dir=part)
    flip_data_bytes(part / "checkpoints" / "iter-000003" / "trainable.safetensors")
    capsys.readouterr()
    train(load_flow_config(None, [*TINY, "train.iterations=4", f"resume={part}"]))
    out = capsys.readouterr().out
    assert "iter-000003" in out and "trainable.safetensors does not match its SHA-256" in out
    assert "resumed from" in out and "iter-000002 after iteration 2" in out
    assert rows(full) == rows(part) and len(rows(part)) == 4
    for name in ("policy.safetensors", "checkpoints/iter-000004/trainable.safetensors",
                 "checkpoints/iter-000004/ema.safetensors"):
        a, b = (load_safetensors_checked(d / name, "test")[0] for d in (full, part))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name  # exact: a resume replays the ops


def test_a_weight_snapshot_holds_the_weights_of_its_last_take_and_a_checkpoint_keeps_it(tmp_path):
    # GARDO's reference and the stale rollout copy's source: the weights as they were when taken, not an average
    from difrl.train.ema import WeightSnapshot

    net = torch.nn.Linear(4, 3)
    snap = WeightSnapshot(dict(net.named_parameters()))
    taken = {k: p.detach().clone() for k, p in net.named_parameters()}
    with torch.no_grad():
        net.weight.add_(1.0)
    assert all(torch.equal(snap.shadow[k], v) for k, v in taken.items())  # unchanged until taken (exact: copies)
    snap.take()
    taken = {k: p.detach().clone() for k, p in net.named_parameters()}
    assert all(torch.equal(snap.shadow[k], v) for k, v in taken.items())  # the live weights exactly, no averaging
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    save_checkpoint(tmp_path, 1, net, opt, None, {}, extras={"source": snap})
    fresh = torch.nn.Linear(4, 3)
    again = WeightSnapshot(dict(fresh.named_parameters()))
    restore_checkpoint(load_latest_checkpoint(tmp_path), fresh, torch.optim.AdamW(fresh.parameters(), lr=0.1), None,
                       {"source": again})
    assert all(torch.equal(again.shadow[k], v) for k, v in taken.items()) and again.num_updates == 1  # bit-exact file

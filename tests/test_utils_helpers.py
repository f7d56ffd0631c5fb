"""The one-place helpers of difrl.utils: uint8 rounding, weights hashing, local-path checks, optional imports and
atomic .npz writes, and the reward layer's wrappers of them (difrl.rewards.base keeps its public signatures).

    .venv/bin/python -m pytest tests/test_utils_helpers.py -q
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from difrl.rewards.base import RewardConfigError, local_dir, local_file, optional_import, sha256_files
from difrl.utils import local
from difrl.utils.images import to_uint8
from difrl.utils.io import atomic_write_npz, sha256_file, weight_files, weights_sha256


class _MyError(ValueError):
    pass


# ------------------------------------------------------------------------------------------------ to_uint8

def test_to_uint8_rounds_floats_and_passes_uint8_through():
    x = torch.tensor([[0.0, 0.6 / 255, 1.49 / 255, 1.51 / 255, 1.0, 1.7, -0.2]])
    assert to_uint8(x).tolist() == [[0, 1, 1, 2, 255, 255, 0]]  # round(255 x), clamped
    pixels = torch.tensor([[0, 1, 128, 255]], dtype=torch.uint8)
    out = to_uint8(pixels)
    assert out.dtype == torch.uint8 and torch.equal(out, pixels)  # not clamped to [0, 1] (which gives 0 / 255)
    images = torch.rand(2, 3, 4, 5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(to_uint8(to_uint8(images)), to_uint8(images))  # idempotent: a saved PNG re-read


# ------------------------------------------------------------------------------------------------ hashing

def _hf_dir(d, safetensors=b"weights-1", bin_=b"old-weights"):
    d.mkdir(parents=True)
    (d / "config.json").write_text('{"model_type": "clip"}')
    (d / "model.safetensors").write_bytes(safetensors)
    (d / "pytorch_model.bin").write_bytes(bin_)  # shadowed by the safetensors
    (d / "vocab.json").write_text("{}")
    (d / "README.md").write_text("docs")
    (d / ".cache").mkdir()
    (d / ".cache" / "x.json").write_text("{}")
    return d


def test_one_file_hashes_as_the_file(tmp_path):
    f = tmp_path / "w.pt"
    f.write_bytes(b"\x00\x01weights" * 1000)
    plain = hashlib.sha256(f.read_bytes()).hexdigest()
    # a checkpoint manifest's digest, a single-file reward's and an extractor's are the same number
    assert sha256_file(f) == weights_sha256([f]) == sha256_files([f]) == plain
    assert weights_sha256([]) == sha256_files([]) == "" and weights_sha256([None]) == ""
    one = tmp_path / "one"
    one.mkdir()
    (one / "model.safetensors").write_bytes(b"abc")
    assert weights_sha256([one]) == hashlib.sha256(b"abc").hexdigest()


def test_directory_hash_covers_what_a_loader_reads(tmp_path):
    d = _hf_dir(tmp_path / "m")
    assert [n for n, _ in weight_files([d])] == ["config.json", "model.safetensors", "vocab.json"]
    h = weights_sha256([d])
    want = hashlib.sha256()
    for name in ("config.json", "model.safetensors", "vocab.json"):
        want.update(name.encode() + b"\0" + (d / name).read_bytes())
    assert h == want.hexdigest()
    # not covered: docs, hidden folders, .bin next to .safetensors
    (d / "README.md").write_text("other docs")
    (d / ".cache" / "x.json").write_text('{"a": 1}')
    (d / "pytorch_model.bin").write_bytes(b"changed")
    assert weights_sha256([d]) == h
    # covered: a weight byte, a config, a tokenizer file; and the same directory given twice counts once
    (d / "model.safetensors").write_bytes(b"weights-2")
    h2 = weights_sha256([d])
    assert h2 != h and weights_sha256([d, d]) == h2 and weights_sha256([d, d / "config.json"]) == h2
    (d / "vocab.json").write_text('{"a": 0}')
    assert weights_sha256([d]) != h2
    # .bin weights count where no .safetensors sit next to them
    (d / "model.safetensors").unlink()
    assert "pytorch_model.bin" in [n for n, _ in weight_files([d])]
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.md").write_text("x")
    with pytest.raises(ValueError, match="no weights or config files"):
        weights_sha256([empty])
    with pytest.raises(FileNotFoundError, match="nowhere"):
        weights_sha256([tmp_path / "nowhere.pt"])


# ------------------------------------------------------------------------------------------------ local paths

def test_local_paths_name_who_the_full_option_and_the_path(tmp_path):
    f = tmp_path / "w.pth"
    f.write_bytes(b"x")
    assert local.local_file(str(f), "the weights", "eval.fid.weights", "InceptionExtractor", _MyError) == f
    with pytest.raises(_MyError, match=r"InceptionExtractor needs the weights: set eval.fid.weights to a local file"):
        local.local_file(None, "the weights", "eval.fid.weights", "InceptionExtractor", _MyError)
    with pytest.raises(_MyError, match=r"not found at .*nope.pth' \(eval.fid.weights; difrl never downloads"):
        local.local_file(tmp_path / "nope.pth", "the weights", "eval.fid.weights", "X", _MyError)
    with pytest.raises(_MyError, match=r"\(opt; it is a directory"):
        local.local_file(tmp_path, "the weights", "opt", "X", _MyError)
    d = _hf_dir(tmp_path / "m")
    assert local.local_dir(d, "the model", "opt", "X", _MyError) == d
    with pytest.raises(_MyError, match=r"X: the model directory .* \(opt\) lacks preprocessor_config.json"):
        local.local_dir(d, "the model", "opt", "X", _MyError, needs=("preprocessor_config.json",))
    with pytest.raises(_MyError, match="directory not found at .*gone.* \\(opt\\)"):
        local.local_dir(tmp_path / "gone", "the model", "opt", "X", _MyError)
    assert local.model_config(d, "opt", "X", _MyError, model_type="clip")["model_type"] == "clip"
    with pytest.raises(_MyError, match=r"holds a 'clip' model, not 'dinov2' \(a DINO\)"):
        local.model_config(d, "opt", "X", _MyError, model_type="dinov2", kind="a DINO")


def test_reward_wrappers_keep_their_signatures_and_texts(tmp_path):
    with pytest.raises(RewardConfigError, match=r"reward 'r' needs the MLP: set reward.options.r.mlp_path to a local"):
        local_file(None, "the MLP", "mlp_path", "r")
    with pytest.raises(RewardConfigError, match=r"reward 'r': the MLP not found at .*x.pth' "
                                                r"\(reward.options.r.mlp_path"):
        local_file(tmp_path / "x.pth", "the MLP", "mlp_path", "r")
    with pytest.raises(RewardConfigError, match=r"reward 'r': the CLIP directory .* \(reward.options.r.model_dir\) "
                                                r"lacks config.json"):
        local_dir(tmp_path, "the CLIP", "model_dir", "r")
    with pytest.raises(RewardConfigError, match=r"reward 'r' needs the package 'difrl_no_such_pkg'.*"
                                                r"pip install 'difrl\[vision\]'. a hint"):
        optional_import("difrl_no_such_pkg", "vision", "r", hint="a hint")
    assert optional_import("json", "x", "r").__name__ == "json"
    with pytest.raises(_MyError, match=r"Ext needs the package .*pip install 'difrl\[eval\]'"):
        local.optional_import("difrl_no_such_pkg", "eval", "Ext", _MyError)


# ------------------------------------------------------------------------------------------------ atomic npz

def test_atomic_write_npz_writes_exactly_the_path_and_keeps_the_old_file_on_failure(tmp_path):
    p = tmp_path / "sub" / "stats.tmpname"  # no .npz suffix: numpy's savez would append one to a file name
    atomic_write_npz(p, mu=np.arange(3.0), n=np.int64(3))
    with np.load(p, allow_pickle=False) as z:
        assert z["mu"].tolist() == [0.0, 1.0, 2.0] and int(z["n"]) == 3
    before = p.read_bytes()
    with pytest.raises(TypeError):  # fails halfway through writing the temporary file
        atomic_write_npz(p, mu=np.arange(4.0), bad=_Unsaveable())
    assert p.read_bytes() == before and sorted(x.name for x in p.parent.iterdir()) == ["stats.tmpname"]


class _Unsaveable:
    def __array__(self, dtype=None, copy=None):
        raise TypeError("cannot be an array")


def test_atomic_writes_get_the_mode_a_plain_open_gives(tmp_path):
    # mkstemp's temporary file is private (0600); the renamed file must read like one open() created (summary.json,
    # report.html and checkpoints are shared with whoever may read the run directory)
    import os

    from difrl.utils.io import atomic_write_json, atomic_write_text, save_safetensors

    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    want = plain.stat().st_mode & 0o777
    atomic_write_text(tmp_path / "a.txt", "x")
    atomic_write_json(tmp_path / "a.json", {"x": 1})
    save_safetensors({"w": torch.zeros(2)}, tmp_path / "a.safetensors")
    atomic_write_npz(tmp_path / "a.npz", mu=np.zeros(2))
    for name in ("a.txt", "a.json", "a.safetensors", "a.npz"):
        assert os.stat(tmp_path / name).st_mode & 0o777 == want, name

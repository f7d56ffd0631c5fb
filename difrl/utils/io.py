"""File I/O with the project's rules: safetensors for weights, atomic writes, loud errors.

    atomic_write_text(path, text)
    save_safetensors(tensors, path, metadata={"hidden": "128"})
    tensors, meta = load_safetensors_checked(path, what="digits classifier")
    digest = sha256_file(path)                    # checkpoint manifests (difrl.train.state)
    json_safe({"fd": float("nan")})               # {"fd": None}: NaN and inf as JSON null
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import safe_open, save_file


def _atomic(path: Path, write) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
    _atomic(Path(path), write)


def atomic_write_json(path: str | Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Atomic safetensors write (contiguous CPU copies; metadata values must be strings)."""
    clean = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    _atomic(Path(path), lambda tmp: save_file(clean, tmp, metadata={k: str(v) for k, v in (metadata or {}).items()}))


def save_torch_state(obj, path: str | Path) -> None:
    """Atomic torch.save for optimizer state (tensors and plain containers only: it loads with weights_only=True)."""
    _atomic(Path(path), lambda tmp: torch.save(obj, tmp))


def load_torch_state(path: str | Path, what: str):
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated or foreign file
        raise ValueError(f"{what} at {path} is corrupted or not a difrl state file ({type(e).__name__}: {e})") from e


def load_safetensors_checked(path: str | Path, what: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Load all tensors and the metadata; a missing or unreadable file names the path and what it should be."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what} not found: {path}")
    if not path.is_file():
        raise FileNotFoundError(f"{what} must be a .safetensors file, but {path} is a directory")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{what} at {path} is not a readable safetensors file ({e})") from e
    return tensors, meta


def sha256_file(path: str | Path) -> str:
    """SHA-256 of one file's bytes (read in 1 MiB blocks)."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def json_safe(obj):
    """`obj` with every non-finite float (NaN, inf) replaced by None, recursively through dicts, lists and
    tuples: what json.dumps(..., allow_nan=False) accepts, so the file is valid JSON (null = not a number)."""
    import math

    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj

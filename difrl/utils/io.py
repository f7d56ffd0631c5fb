"""File I/O with the project's rules: safetensors for weights, atomic writes, loud errors.

    atomic_write_text(path, text)
    save_safetensors(tensors, path, metadata={"hidden": "128"})
    tensors, meta = load_safetensors_checked(path, what="digits classifier")
    atomic_write_npz(path, mu=mu, sigma=sigma)    # np.load(path, allow_pickle=False) reads it back
    digest = sha256_file(path)                    # checkpoint manifests (difrl.train.run.state)
    digest = weights_sha256([model_dir, processor_dir])   # a model's identity (rewards, FD extractors)
    json_safe({"fd": float("nan")})               # {"fd": None}: NaN and inf as JSON null
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import safe_open, save_file


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    return mask


_FILE_MODE = 0o666 & ~_umask()  # what open() would give a new file (mkstemp's temporary file is 0600)


def _atomic(path: Path, write) -> None:
    """Write through a temporary file in the same directory, fsync, then rename over `path`: a reader sees the old
    file or the new one, never a part. The file gets the permissions a plain open() would give it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, _FILE_MODE)  # after the write: a writer may recreate the file (safetensors does)
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


def atomic_write_npz(path: str | Path, **arrays) -> None:
    """Atomic `np.savez` of `arrays` to exactly `path` (numpy would append .npz to a file name without it)."""
    import numpy as np

    def write(tmp):
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
    _atomic(Path(path), write)


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
    """SHA-256 of one file's bytes: what `sha256sum` prints."""
    return _hash_file_into(hashlib.sha256(), path).hexdigest()


def _hash_file_into(h, path):
    """Feed `path`'s bytes to the hash object `h` in 1 MiB blocks; returns `h`."""
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h


# what a loader reads from a weights directory: weights, and the configs / vocabularies that shape the features
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".onnx", ".npz", ".npy")
CONFIG_SUFFIXES = (".json", ".txt", ".model", ".yaml", ".yml")


def weight_files(paths) -> list[tuple[str, Path]]:
    """The (name, file) pairs `weights_sha256` covers, in order: each file given as itself (named by its file
    name); each directory as its files, recursively, sorted by their path relative to it (which names them),
    that a loader reads: weights (WEIGHT_SUFFIXES) and configs / tokenizer vocabularies (CONFIG_SUFFIXES).
    Hidden files and folders (.git, .cache) are skipped, and so are `.bin` weights in a folder that holds
    `.safetensors` ones (transformers and diffusers load those instead); documentation and other frameworks'
    weights (README.md, flax_model.msgpack, tf_model.h5) are not part of a torch model's identity. A path
    given twice (or a file inside a directory already given) counts once."""
    out: list[tuple[str, Path]] = []
    seen: set[Path] = set()

    def add(name: str, f: Path):
        if f.resolve() not in seen:
            seen.add(f.resolve())
            out.append((name, f))

    for p in (Path(p).expanduser() for p in paths if p not in (None, "")):
        if not p.is_dir():
            if not p.is_file():
                raise FileNotFoundError(f"weights file not found: {p}")
            add(p.name, p)
            continue
        files = sorted((f for f in p.rglob("*") if f.is_file() and not any(
            part.startswith(".") for part in f.relative_to(p).parts)), key=lambda f: f.relative_to(p).as_posix())
        with_st = {f.parent for f in files if f.suffix == ".safetensors"}
        for f in files:
            if f.suffix in CONFIG_SUFFIXES or (f.suffix in WEIGHT_SUFFIXES
                                               and not (f.suffix == ".bin" and f.parent in with_st)):
                add(f.relative_to(p).as_posix(), f)
    return out


def weights_sha256(paths) -> str:
    """The identity of a model's weights, one definition for rewards (`Reward.info()["weights_sha256"]`, the
    reward server's handshake) and FD extractors (the report, the reference-statistics cache key).

    It covers the files of `weight_files(paths)`: for a single weights file (or a directory holding only one
    such file) it is that file's plain `sha256_file` (so a checkpoint manifest's digest, or `sha256sum`, is
    the weights hash); for several, one SHA-256 over (name, NUL, bytes) of each in order, so renaming or
    reordering files changes it. A CLIP reward and a CLIP extractor built on the same directories report the
    same hash. '' when no path is given; a directory with no weight or config file is an error."""
    paths = [p for p in (paths or []) if p not in (None, "")]
    if not paths:
        return ""
    files = weight_files(paths)
    if not files:
        raise ValueError(f"no weights or config files in {[str(p) for p in paths]} (looked for "
                         f"{', '.join(WEIGHT_SUFFIXES + CONFIG_SUFFIXES)})")
    if len(files) == 1:
        return sha256_file(files[0][1])
    h = hashlib.sha256()
    for name, f in files:
        h.update(name.encode() + b"\0")
        _hash_file_into(h, f)
    return h.hexdigest()


def state_dict_sha256(module: torch.nn.Module) -> str:
    """SHA-256 over a module's state dict (names, dtypes, shapes and bytes, in key order): the identity of an
    in-memory model's weights (difrl.eval.extractors.ModuleExtractor), where `weights_sha256` names files."""
    h = hashlib.sha256()
    for k, v in module.state_dict().items():
        t = v.detach().cpu().contiguous()
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}\0".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
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

"""The reward server's wire format (protocol 1): msgpack, raw arrays, no pickle. Shared by server and client.

    body = pack_request("req-1", "hpsv2", images, prompts, metadata, encoding="raw")    # bytes
    request = unpack_request(body, limits)                                            # checked dict
    samples = decode_sample(request["items"][0]["sample"])                           # torch tensor

Request (POST /v1/score, Content-Type application/msgpack, Authorization: Bearer <token>)::

    {"protocol": 1, "request_id": str, "reward": str, "expect_version": str | None,
     "items": [{"id": str, "prompt": str, "metadata": {...}, "sample": SAMPLE}, ...]}
    SAMPLE = {"encoding": "raw", "dtype": "uint8" | "float32" | ..., "shape": [...], "data": bytes}
           | {"encoding": "png" | "jpeg", "frames": int, "data": [bytes, ...]}       # images / video frames

Images travel as their uint8 pixels (round(255 x), lossless for what an image file would hold) by
default; "raw32" keeps the float32 samples bit for bit (a remote reward then equals the in-process
one bit for bit when scored in the same batch; batched with other requests' items, CPU kernels may
differ in the last float32 bits); "png" is lossless and smaller on the wire but costs ~0.1 s of CPU per 1024² image;
"jpeg" (quality 95) is lossy: the remote reward then scores other pixels, so it is an explicit opt-in
that the response records. Metadata is JSON-like; tensors in it (a Sudoku puzzle) travel as raw
SAMPLEs marked {"__tensor__": true}.

Response::

    {"protocol": 1, "request_id": str, "reward": {"name", "key", "version", "weights_sha256", "modality"},
     "encoding": str, "results": [{"id": str, "status": "ok", "scores": {key: float}}
                                  | {"id": str, "status": "error", "error": str}, ...],
     "timing_ms": float}
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import torch

from difrl.utils.images import to_uint8

PROTOCOL = 1
ENCODINGS = ("raw", "raw32", "png", "jpeg")
DTYPES = {"uint8": torch.uint8, "float32": torch.float32, "float16": torch.float16, "int64": torch.int64,
          "int32": torch.int32, "bool": torch.bool}  # what may cross the wire (no object arrays, nothing else)


class WireError(ValueError):
    """A request or response that does not follow the protocol (the server answers 400, the client raises)."""


class LimitError(WireError):
    """Over one of the server's limits (the server answers 413)."""


@dataclass
class Limits:
    """What one request may carry (the server answers 413 beyond them)."""
    max_body_bytes: int = 256 << 20
    max_items: int = 512
    max_pixels: int = 4096 * 4096  # per item, all frames together (H * W * frames)


# ------------------------------------------------------------------------------------------ samples


def _is_image(t: torch.Tensor) -> bool:
    return t.is_floating_point() and t.ndim in (3, 4) and t.shape[-3] == 3  # [3, H, W] or [F, 3, H, W]


def encode_sample(sample, encoding: str = "raw") -> dict:
    """One sample -> SAMPLE. Float images [3, H, W] / [F, 3, H, W] in [0, 1] go as uint8 pixels ("raw"), float32
    ("raw32"), PNG or JPEG frames; any other tensor (tokens, digit grids) as raw bytes of its own dtype."""
    t = torch.as_tensor(sample).detach().cpu()
    if encoding not in ENCODINGS:
        raise WireError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
    if _is_image(t) and encoding != "raw32":
        pixels = to_uint8(t)
        if encoding == "raw":
            return _raw(pixels)
        from PIL import Image

        frames = pixels.reshape(-1, *pixels.shape[-3:]).permute(0, 2, 3, 1).numpy()  # [F, H, W, 3]
        out = []
        for f in frames:
            buf = io.BytesIO()
            Image.fromarray(f).save(buf, format="PNG" if encoding == "png" else "JPEG",
                                    **({"compress_level": 1} if encoding == "png" else {"quality": 95}))
            out.append(buf.getvalue())
        return {"encoding": encoding, "frames": len(out) if pixels.ndim == 4 else 0, "data": out}
    if t.is_floating_point():
        t = t.float()
    return _raw(t)


def _raw(t: torch.Tensor) -> dict:
    name = str(t.dtype).replace("torch.", "")
    if name not in DTYPES:
        raise WireError(f"dtype {name} cannot cross the wire (allowed: {sorted(DTYPES)})")
    return {"encoding": "raw", "dtype": name, "shape": list(t.shape), "data": t.contiguous().numpy().tobytes()}


def decode_sample(s: dict, limits: Limits | None = None) -> torch.Tensor:
    """SAMPLE -> tensor: uint8 images back to float in [0, 1] ([3, H, W] or [F, 3, H, W]), others as sent."""
    if not isinstance(s, dict) or s.get("encoding") not in ("raw", "png", "jpeg"):
        raise WireError("a sample must be a map with encoding raw, png or jpeg")
    if s["encoding"] == "raw":
        dtype, shape, data = s.get("dtype"), s.get("shape"), s.get("data")
        if dtype not in DTYPES or not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape) \
                or not isinstance(data, bytes):
            raise WireError("a raw sample needs dtype (one of %s), shape (a list of ints) and data (bytes)" % sorted(DTYPES))
        _check_pixels(shape, limits)
        n = int(np.prod(shape)) if shape else 1
        itemsize = torch.empty((), dtype=DTYPES[dtype]).element_size()
        if len(data) != n * itemsize:
            raise WireError(f"a raw {dtype} sample of shape {shape} needs {n * itemsize} bytes, got {len(data)}")
        np_dtype = np.bool_ if dtype == "bool" else np.dtype(dtype)
        t = torch.from_numpy(np.frombuffer(data, dtype=np_dtype).copy()).reshape(shape)
        return t.float() / 255.0 if dtype == "uint8" and t.ndim in (3, 4) and t.shape[-3] == 3 else t
    from PIL import Image

    frames, data = s.get("frames"), s.get("data")
    if not isinstance(data, list) or not data or not all(isinstance(d, bytes) for d in data) \
            or not isinstance(frames, int) or frames not in (0, len(data)):
        raise WireError("a png/jpeg sample needs data (a list of encoded frames) and frames (0 for one image)")
    out = []
    for d in data:
        try:
            img = Image.open(io.BytesIO(d))
            _check_pixels([img.height, img.width, len(data)], limits)
            out.append(torch.from_numpy(np.asarray(img.convert("RGB")).copy()).permute(2, 0, 1))
        except WireError:
            raise
        except Exception as e:
            raise WireError(f"cannot decode a {s['encoding']} frame: {e}") from e
    pixels = torch.stack(out) if frames else out[0]
    return pixels.float() / 255.0


def _check_pixels(shape: list[int], limits: Limits | None) -> None:
    if limits is not None and int(np.prod(shape)) > 3 * limits.max_pixels:
        raise LimitError(f"a sample of shape {shape} exceeds the server's {limits.max_pixels} pixels per item")


# ------------------------------------------------------------------------------------------ metadata


def encode_metadata(meta):
    if torch.is_tensor(meta):
        return {"__tensor__": True, **_raw(meta.detach().cpu())}
    if isinstance(meta, dict):
        return {str(k): encode_metadata(v) for k, v in meta.items()}
    if isinstance(meta, (list, tuple)):
        return [encode_metadata(v) for v in meta]
    if isinstance(meta, (str, int, float, bool)) or meta is None:
        return meta
    if isinstance(meta, np.generic):
        return meta.item()
    raise WireError(f"metadata values must be JSON-like or tensors, got {type(meta).__name__}")


def decode_metadata(meta):
    if isinstance(meta, dict):
        if meta.get("__tensor__") is True:
            return decode_sample({k: v for k, v in meta.items() if k != "__tensor__"})
        return {k: decode_metadata(v) for k, v in meta.items()}
    if isinstance(meta, list):
        return [decode_metadata(v) for v in meta]
    return meta


# ------------------------------------------------------------------------------------------ messages


def pack(obj) -> bytes:
    import msgpack  # the `server` extra

    return msgpack.packb(obj, use_bin_type=True)


def unpack(body: bytes):
    import msgpack

    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as e:
        raise WireError(f"not a msgpack body: {type(e).__name__}: {e}") from e


def pack_request(request_id: str, reward: str, samples, prompts: list[str], metadata: list[dict],
                 ids: list[str] | None = None, encoding: str = "raw", expect_version: str | None = None) -> bytes:
    ids = ids if ids is not None else [f"{request_id}:{i}" for i in range(len(prompts))]
    items = [{"id": ids[i], "prompt": prompts[i], "metadata": encode_metadata(metadata[i]),
              "sample": encode_sample(samples[i], encoding)} for i in range(len(prompts))]
    return pack({"protocol": PROTOCOL, "request_id": request_id, "reward": reward, "expect_version": expect_version,
                 "encoding": encoding, "items": items})


def unpack_request(body: bytes, limits: Limits) -> dict:
    """A checked request (samples still encoded); WireError for anything malformed, LimitError over the limits."""
    req = unpack(body)
    if not isinstance(req, dict):
        raise WireError("the body must be a msgpack map")
    if req.get("protocol") != PROTOCOL:
        raise WireError(f"protocol {req.get('protocol')!r} is not supported (this server speaks {PROTOCOL})")
    for key, kind in (("request_id", str), ("reward", str), ("items", list)):
        if not isinstance(req.get(key), kind):
            raise WireError(f"the request needs {key!r} ({kind.__name__})")
    if len(req["items"]) > limits.max_items:
        raise LimitError(f"{len(req['items'])} items in one request; this server takes at most {limits.max_items}")
    ids = set()
    for item in req["items"]:
        if not isinstance(item, dict) or not isinstance(item.get("id"), str) or not isinstance(item.get("prompt"), str) \
                or "sample" not in item:
            raise WireError("every item needs id (str), prompt (str) and sample")
        if item["id"] in ids:
            raise WireError(f"item id {item['id']!r} appears twice")
        ids.add(item["id"])
        if not isinstance(item.get("metadata", {}), dict):
            raise WireError(f"item {item['id']!r}: metadata must be a map")
    return req


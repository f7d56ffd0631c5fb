"""Low-precision number formats as exact quantize / dequantize in pure torch (runs on CPU).

    from difrl.quant import formats as F
    x_hat = F.qdq(x, "nvfp4", "activation")          # fake-quant: dequantize(quantize(x)), fp32
    q = F.quantize(w, "nvfp4", "weight")              # packed storage: two E2M1 codes per byte + E4M3 scales
    w_hat = F.dequantize(q); q.nbytes                 # the bytes the quantized copy really takes

The numerics are written from Transformer Engine's documented forward path
(docs/reference/specs/lowprec-and-correctors.md §2-3; never run against TE itself, no GPU was used; tests compare with
torchao, see tests/test_quant.py):

- ``nvfp4``  E2M1 values {0, .5, 1, 1.5, 2, 3, 4, 6}, one E4M3 scale per 16 elements along the reduction
  (last) dim, one FP32 scale per tensor. Activations use 1x16 blocks, weights 16x16 tiles (TE's
  default ``NVFP4BlockScaling``). S_enc = 448*6/amax; s_b = e4m3(min(amax_b*S_enc/6, 448));
  q = e2m1_rne_satfinite(x / (s_b/S_enc)); x_hat = q * s_b / S_enc. No RHT and no stochastic rounding:
  TE applies those to backward tensors only, and rollouts are forward only.
- ``nvfp4_single`` single-level NVFP4 (torchao's ``nvfp4_quantize`` without a per-tensor scale): the same
  E2M1 values and 1x16 / 16x16 blocks, but only the E4M3 block scale s_b = e4m3(clamp(amax_b/6, 2^-6, 448)),
  no FP32 tensor scale: blocks with amax_b > 6*448 saturate, blocks below 6*2^-6 use the scale 2^-6.
  Transformer Engine has no such recipe (its NVFP4 is always two-level).
- ``mxfp8``  E4M3 values, one E8M0 (power of two) scale per 32 elements: s = 2^ceil(log2(amax_b/448)) (the
  "RCEIL" rounding of TE's MXFP8BlockScaling and cuBLAS: no element overflows 448).
- ``mxfp8_floor`` MXFP8 with the OCP MX v1.0 spec's scale (§6.3, torchao's default FLOOR mode):
  s = 2^(floor(log2 amax_b) - 8), 8 = E4M3's largest exponent; elements above 448 * s saturate to 448.
- ``fp8``    E4M3 with one FP32 scale per tensor from the current amax (``Float8CurrentScaling``).
- ``fp8_row`` E4M3 with one FP32 scale per row from that row's current amax: per token for activations,
  per output channel for weights (torchao's ``PerRow`` float8 inference granularity; the layout
  ``torch._scaled_mm`` takes as rowwise scales). Scale 448/amax_row (1 for an all-zero row), as ``fp8``.
- ``fp8_block`` E4M3, 1x128 blocks for activations and 128x128 tiles for weights, scale 448/amax_b
  rounded down to a power of two (``Float8BlockScaling``, the DeepSeek-V3 recipe).
- ``bf16``   a plain cast (the reference rollout precision).

Every function works on the last dimension (the GEMM reduction dim K of ``x [.., K]`` and ``W [N, K]``)
and pads it with zeros to a whole number of blocks; padding never changes a block's amax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of codes 0..7 (sign is bit 3)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E5M2_MAX = 57344.0
NVFP4_BLOCK = 16
MX_BLOCK = 32
FP8_BLOCK = 128
_FLT_MAX = torch.finfo(torch.float32).max

_GRID = torch.tensor(E2M1_GRID)
_MIDPOINTS = (_GRID[1:] + _GRID[:-1]) / 2  # [7]: 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5


# ---------------------------------------------------------------------------------- element casts


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes (bit 3 sign, bits 0-2 the grid index) of fp32 `x`: round to nearest, ties to the
    even code (an even mantissa bit), |x| > 6 saturates to 6 (cvt.rn.satfinite)."""
    a = x.abs().clamp(max=E2M1_MAX).contiguous()
    mid = _MIDPOINTS.to(a.device)
    down = torch.searchsorted(mid, a, right=False)  # ties go to the lower code ...
    up = torch.searchsorted(mid, a, right=True)  # ... or to the upper one
    idx = torch.where((down != up) & (down % 2 == 1), up, down)  # at a tie, the even one of the two
    sign = torch.signbit(x)  # -0.0, and a negative value that rounds to zero, keep the sign (-0) as the hardware cast does
    return (idx | (sign.to(idx.dtype) << 3)).to(torch.uint8)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of uint8 E2M1 codes."""
    c = codes.long()
    mag = _GRID.to(codes.device)[c & 7]
    return torch.where(c & 8 != 0, -mag, mag)


def cast_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 `x` onto the E2M1 grid (RNE, saturating), arithmetically: the grid spacing is 0.5 below 2,
    1 in [2, 4) and 2 in [4, 6], and torch.round is round-half-to-even, which at each spacing picks the even
    code exactly as `e2m1_codes` does (tested against it on every tie). About 4x faster than the lookup."""
    a = x.abs().clamp(max=E2M1_MAX)
    q = torch.where(a < 2, torch.round(a * 2) * 0.5, torch.where(a < 4, torch.round(a), torch.round(a * 0.5) * 2))
    return torch.where(x < 0, -q, q)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte along the last dim (element 2i in the low nibble, 2i+1 in the high, as torchao)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"packing needs an even last dimension, got {tuple(codes.shape)}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


def cast_fp8(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """Saturating RNE cast to an FP8 dtype (clamped first: never rely on the cast's own overflow)."""
    fmax = torch.finfo(dtype).max
    return x.clamp(-fmax, fmax).to(dtype)


# ---------------------------------------------------------------------------------- blocks


def _pad_last(x: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-x.shape[-1]) % multiple
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def _block_amax(x: torch.Tensor, block: int, tile_rows: int = 1) -> torch.Tensor:
    """amax of each 1 x `block` block along the last dim, or of each `tile_rows` x `block` tile of the last
    two dims, broadcast back to x's shape. x's last dim must be a multiple of `block` (rows of `tile_rows`)."""
    *lead, K = x.shape
    if tile_rows == 1:
        a = x.abs().view(*lead, K // block, block).amax(-1, keepdim=True)
        return a.expand(*lead, K // block, block).reshape(x.shape)
    *outer, N = lead
    t = x.abs().view(*outer, N // tile_rows, tile_rows, K // block, block).amax(dim=(-3, -1), keepdim=True)
    return t.expand(*outer, N // tile_rows, tile_rows, K // block, block).reshape(x.shape)


def _pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-x.shape[-2]) % multiple
    return torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x


def _crop(x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    return x[tuple(slice(0, s) for s in shape)]


# ---------------------------------------------------------------------------------- NVFP4


def nvfp4_global_encode(amax: torch.Tensor) -> torch.Tensor:
    """S_enc = 448*6 / amax (fp32), 1 for an all-zero tensor (TE compute_global_encode_scaling_factor_FP4)."""
    amax = amax.float()
    s = (E4M3_MAX * E2M1_MAX) / amax
    s = torch.where((amax == 0) | (s == 0), torch.ones_like(s), s.clamp(max=_FLT_MAX))
    return s


def nvfp4_parts(x: torch.Tensor, tile_rows: int = 1, tensor_amax: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(E2M1 codes [padded shape] uint8, block scales s_b as float8_e4m3fn [padded shape], S_dec fp32 scalar).
    The block scale is expanded over its block here; `quantize` keeps one per block. `tensor_amax`: the amax
    the per-tensor scale comes from (default x's own; a slice of rows of a weight passes the whole weight's)."""
    x = x.float()
    if tile_rows > 1:
        x = _pad_rows(x, tile_rows)
    x = _pad_last(x, NVFP4_BLOCK)
    s_enc = nvfp4_global_encode(x.abs().amax() if tensor_amax is None else tensor_amax)
    s_dec = 1.0 / s_enc
    amax_b = _block_amax(x, NVFP4_BLOCK, tile_rows)
    s_b = cast_fp8((amax_b * s_enc / E2M1_MAX).clamp(max=E4M3_MAX))  # e4m3, RNE
    # TE: enc = min(1 / (float(s_b) * S_dec), FLT_MAX); an all-zero block (s_b = 0) encodes to zeros
    enc = (1.0 / (s_b.float() * s_dec)).clamp(max=_FLT_MAX)
    codes = e2m1_codes(x * enc)
    return codes, s_b, s_dec


def nvfp4_qdq(x: torch.Tensor, tile_rows: int = 1) -> torch.Tensor:
    """NVFP4 fake-quant of x (fp32 result, x's shape). tile_rows=16 gives TE's 16x16 weight tiles.
    The same arithmetic as `nvfp4_parts`, on a blocked view (no expanded scale tensors, no codes)."""
    if tile_rows > 1:
        codes, s_b, s_dec = nvfp4_parts(x, tile_rows)
        return _crop(e2m1_values(codes) * s_b.float() * s_dec, x.shape)
    xp = _pad_last(x.float(), NVFP4_BLOCK)
    *lead, K = xp.shape
    xb = xp.view(*lead, K // NVFP4_BLOCK, NVFP4_BLOCK)
    s_enc = nvfp4_global_encode(xp.abs().amax())
    s_dec = 1.0 / s_enc
    s_b = cast_fp8((xb.abs().amax(-1, keepdim=True) * s_enc / E2M1_MAX).clamp(max=E4M3_MAX)).float()
    enc = (1.0 / (s_b * s_dec)).clamp(max=_FLT_MAX)
    return _crop((cast_e2m1(xb * enc) * s_b * s_dec).view(xp.shape), x.shape)


def nvfp4_single_parts(x: torch.Tensor, tile_rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-level NVFP4: (E2M1 codes [padded shape] uint8, block scales float8_e4m3fn [padded shape]).
    s_b = e4m3(clamp(amax_b / 6, 2^-6, 448)) (torchao clamps to E4M3's smallest normal, so an all-zero block has
    scale 2^-6, never 0); q = e2m1_rne_satfinite(x * (1 / s_b)); x_hat = q * s_b."""
    x = x.float()
    if tile_rows > 1:
        x = _pad_rows(x, tile_rows)
    x = _pad_last(x, NVFP4_BLOCK)
    tiny = torch.finfo(torch.float8_e4m3fn).tiny  # 2^-6
    s_b = cast_fp8((_block_amax(x, NVFP4_BLOCK, tile_rows) / E2M1_MAX).clamp(min=tiny, max=E4M3_MAX))
    return e2m1_codes(x * (1.0 / s_b.float())), s_b


def nvfp4_single_qdq(x: torch.Tensor, tile_rows: int = 1) -> torch.Tensor:
    codes, s_b = nvfp4_single_parts(x, tile_rows)
    return _crop(e2m1_values(codes) * s_b.float(), x.shape)


# ---------------------------------------------------------------------------------- FP8 family


def fp8_tensor_qdq(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """Per-tensor current scaling: scale = fp8_max / amax (1 if amax = 0), x_hat = fp8(x * scale) / scale."""
    q, scale_inv = _fp8_tensor(x, dtype)
    return q.float() * scale_inv


def _fp8_tensor(x: torch.Tensor, dtype: torch.dtype, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.float()
    amax = x.abs().amax() if amax is None else amax.float()
    scale = torch.where(amax > 0, torch.finfo(dtype).max / amax, torch.ones_like(amax)).clamp(max=_FLT_MAX)
    return cast_fp8(x * scale, dtype), 1.0 / scale


def _fp8_rows(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise current scaling: (E4M3 values [.., K], dequantization scale 1/scale [.., 1] fp32), one scale per row
    of the last dim (per token of x [.., K], per output channel of W [N, K])."""
    x = x.float()
    return _fp8_tensor(x, dtype, amax=x.abs().amax(-1, keepdim=True))


def _e8m0_scale(amax_b: torch.Tensor) -> torch.Tensor:
    """MXFP8 block scale 2^ceil(log2(amax_b / 448)), within E8M0's [2^-127, 2^127]; 2^-127 for a zero block."""
    e = torch.ceil(torch.log2(amax_b / E4M3_MAX)).clamp(-127, 127)
    e = torch.where(amax_b > 0, e, torch.full_like(e, -127.0))
    return torch.exp2(e)


E4M3_EMAX = 8  # the largest E4M3 exponent: 448 = 1.75 * 2^8


def _e8m0_floor_scale(amax_b: torch.Tensor) -> torch.Tensor:
    """OCP MX v1.0 §6.3: 2^(floor(log2 amax_b) - emax_elem), within E8M0's [2^-127, 2^127]. floor(log2) is read
    from the fp32 exponent bits, as torchao does (a subnormal or zero amax counts as 2^-127)."""
    pow2 = ((amax_b.float().contiguous().view(torch.int32) >> 23) & 0xFF) - 127
    return torch.exp2((pow2 - E4M3_EMAX).clamp(-127, 127).float())


def mxfp8_qdq(x: torch.Tensor, floor: bool = False) -> torch.Tensor:
    q, s = _mxfp8(x, floor)
    return _crop(q.float() * s, x.shape)


def _mxfp8(x: torch.Tensor, floor: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    x = _pad_last(x.float(), MX_BLOCK)
    amax_b = _block_amax(x, MX_BLOCK)
    s = _e8m0_floor_scale(amax_b) if floor else _e8m0_scale(amax_b)
    return cast_fp8(x / s), s  # division by a power of two is exact; FLOOR: up to 2x above 448, saturated


def _pow2_floor(s: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.floor(torch.log2(s)))


def fp8_block_qdq(x: torch.Tensor, tile_rows: int = 1) -> torch.Tensor:
    """Float8BlockScaling: scale 448/amax_b per 1x128 block (tile_rows=128: per 128x128 tile), rounded down to a
    power of two; a zero block gets scale 1."""
    q, s = _fp8_block(x, tile_rows)
    return _crop(q.float() / s, x.shape)


def _fp8_block(x: torch.Tensor, tile_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.float()
    if tile_rows > 1:
        x = _pad_rows(x, tile_rows)
    x = _pad_last(x, FP8_BLOCK)
    amax_b = _block_amax(x, FP8_BLOCK, tile_rows)
    s = torch.where(amax_b > 0, _pow2_floor(E4M3_MAX / amax_b.clamp(min=1e-38)), torch.ones_like(amax_b))
    return cast_fp8(x * s), s


# ---------------------------------------------------------------------------------- storage


@dataclass
class Quantized:
    """A tensor stored in a low-precision format: `data` holds exactly what a kernel would read.

    nvfp4: codes uint8 [.., K/2] (two per byte), scales float8_e4m3fn one per block, s_dec fp32 scalar.
    fp8 / fp8_row / mxfp8 / fp8_block: data float8_e4m3fn, scale_inv fp32 [1] (per tensor) / scale_inv fp32 [.., 1]
    (per row) / E8M0 exponents int8 / fp32 scales per block.
    bf16: data bfloat16."""

    fmt: str
    role: str
    shape: torch.Size
    data: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.data.values())


ROLES = ("activation", "weight")


def weight_tile_rows(fmt: str) -> int:
    """Rows of a weight's scale tile: 16 (NVFP4's 16x16), 128 (fp8_block's 128x128), else 1 (1-D blocks)."""
    return {"nvfp4": NVFP4_BLOCK, "nvfp4_single": NVFP4_BLOCK, "fp8_block": FP8_BLOCK}.get(fmt, 1)


def _tile_rows(fmt: str, role: str, x: torch.Tensor) -> int:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if role == "weight" and x.ndim >= 2:
        return weight_tile_rows(fmt)
    return 1


def quantize(x: torch.Tensor, fmt: str, role: str = "weight") -> Quantized:
    _check_format(fmt)
    tr = _tile_rows(fmt, role, x)
    if fmt == "nvfp4":
        codes, s_b, s_dec = nvfp4_parts(x, tr)
        *lead, K = codes.shape
        if tr > 1:  # one scale per 16x16 tile
            *outer, N = lead
            scales = s_b.view(*outer, N // tr, tr, K // NVFP4_BLOCK, NVFP4_BLOCK)[..., 0, :, 0]
        else:
            scales = s_b.view(*lead, K // NVFP4_BLOCK, NVFP4_BLOCK)[..., 0]
        data = {"codes": pack_e2m1(codes), "scales": scales.contiguous(), "s_dec": s_dec.reshape(1)}
    elif fmt == "nvfp4_single":
        codes, s_b = nvfp4_single_parts(x, tr)
        *lead, K = codes.shape
        if tr > 1:
            *outer, N = lead
            scales = s_b.view(*outer, N // tr, tr, K // NVFP4_BLOCK, NVFP4_BLOCK)[..., 0, :, 0]
        else:
            scales = s_b.view(*lead, K // NVFP4_BLOCK, NVFP4_BLOCK)[..., 0]
        data = {"codes": pack_e2m1(codes), "scales": scales.contiguous()}
    elif fmt == "fp8":
        q, scale_inv = _fp8_tensor(x, torch.float8_e4m3fn)
        data = {"data": q, "scale_inv": scale_inv.reshape(1)}
    elif fmt == "fp8_row":
        q, scale_inv = _fp8_rows(x)
        data = {"data": q, "scale_inv": scale_inv}
    elif fmt in ("mxfp8", "mxfp8_floor"):
        q, s = _mxfp8(x, fmt == "mxfp8_floor")
        *lead, K = q.shape
        exps = torch.log2(s.view(*lead, K // MX_BLOCK, MX_BLOCK)[..., 0]).to(torch.int8)  # E8M0 exponent (unbiased)
        data = {"data": q, "exponents": exps}
    elif fmt == "fp8_block":
        q, s = _fp8_block(x, tr)
        *lead, K = q.shape
        if tr > 1:
            *outer, N = lead
            scales = s.view(*outer, N // tr, tr, K // FP8_BLOCK, FP8_BLOCK)[..., 0, :, 0]
        else:
            scales = s.view(*lead, K // FP8_BLOCK, FP8_BLOCK)[..., 0]
        data = {"data": q, "scales": scales.contiguous()}
    else:  # bf16
        data = {"data": x.to(torch.bfloat16)}
    return Quantized(fmt, role, x.shape, data)


def _expand_blocks(scales: torch.Tensor, block: int, tile_rows: int) -> torch.Tensor:
    s = scales.repeat_interleave(block, dim=-1)
    return s.repeat_interleave(tile_rows, dim=-2) if tile_rows > 1 else s


def dequantize(q: Quantized) -> torch.Tensor:
    """fp32 values of `q` in its original shape."""
    d = q.data
    tr = 1
    if q.role == "weight" and len(q.shape) >= 2:
        tr = weight_tile_rows(q.fmt)
    if q.fmt == "nvfp4":
        x = e2m1_values(unpack_e2m1(d["codes"])) * _expand_blocks(d["scales"].float(), NVFP4_BLOCK, tr) * d["s_dec"]
    elif q.fmt == "nvfp4_single":
        x = e2m1_values(unpack_e2m1(d["codes"])) * _expand_blocks(d["scales"].float(), NVFP4_BLOCK, tr)
    elif q.fmt in ("fp8", "fp8_row"):
        x = d["data"].float() * d["scale_inv"]
    elif q.fmt in ("mxfp8", "mxfp8_floor"):
        x = d["data"].float() * torch.exp2(_expand_blocks(d["exponents"].float(), MX_BLOCK, 1))
    elif q.fmt == "fp8_block":
        x = d["data"].float() / _expand_blocks(d["scales"], FP8_BLOCK, tr)
    else:
        x = d["data"].float()
    return _crop(x, q.shape)


FORMATS = ("bf16", "fp8", "fp8_row", "fp8_block", "mxfp8", "mxfp8_floor", "nvfp4", "nvfp4_single")


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown low-precision format {fmt!r}; choose one of {FORMATS}")


def qdq(x: torch.Tensor, fmt: str, role: str = "activation") -> torch.Tensor:
    """Fake-quant: dequantize(quantize(x)) in fp32 without building the packed storage."""
    _check_format(fmt)
    tr = _tile_rows(fmt, role, x)
    if fmt == "nvfp4":
        return nvfp4_qdq(x, tr)
    if fmt == "nvfp4_single":
        return nvfp4_single_qdq(x, tr)
    if fmt == "fp8":
        return fp8_tensor_qdq(x)
    if fmt == "fp8_row":
        q, scale_inv = _fp8_rows(x)
        return q.float() * scale_inv
    if fmt in ("mxfp8", "mxfp8_floor"):
        return mxfp8_qdq(x, fmt == "mxfp8_floor")
    if fmt == "fp8_block":
        return fp8_block_qdq(x, tr)
    return x.to(torch.bfloat16).float()


def qdq_weight_rows(w: torch.Tensor, fmt: str, start: int, stop: int) -> torch.Tensor:
    """qdq(w, fmt, "weight")[start:stop] for a weight w [N, K], computed from those rows and w's amax only (the
    per-tensor scale of nvfp4 / fp8): a sampled check of a quantized copy without re-quantizing all of w.
    start and stop must lie on the format's scale tiles (weight_tile_rows; stop may be N)."""
    _check_format(fmt)
    tr = weight_tile_rows(fmt)
    if start % tr or (stop % tr and stop != w.shape[0]) or not 0 <= start < stop <= w.shape[0]:
        raise ValueError(f"rows [{start}, {stop}) of a [{w.shape[0]}, ...] weight do not lie on {fmt}'s {tr}-row tiles")
    part = w[start:stop]
    if fmt == "nvfp4":
        codes, s_b, s_dec = nvfp4_parts(part, tr, tensor_amax=w.abs().amax())
        return _crop(e2m1_values(codes) * s_b.float() * s_dec, part.shape)
    if fmt == "fp8":
        q, scale_inv = _fp8_tensor(part, torch.float8_e4m3fn, amax=w.abs().amax())
        return q.float() * scale_inv
    return qdq(part, fmt, "weight")  # block-local formats


def relative_error(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """||x_hat - x||_F / ||x||_F."""
    return float((x_hat.float() - x.float()).norm() / x.float().norm().clamp(min=1e-30))


def cosine(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """Cosine similarity of the flattened tensors, in fp64."""
    return float(torch.nn.functional.cosine_similarity(x.flatten().double(), x_hat.flatten().double(), dim=0))

"""GPU: a FLUX-size transformer block forward in BF16 vs each low-precision backend x format that runs here.

    .venv/bin/python benchmarks/gpu_lowprec.py                 # on an NVIDIA GPU with TE; updates BENCHMARKS.md
    .venv/bin/python benchmarks/gpu_lowprec.py --quick --json /tmp/gpu.json --no-write

The block is a self-contained FLUX-like single-stream block in plain torch (hidden 3072, 24 heads, MLP ratio
4, 4096 image + 512 text tokens, SDPA attention): adaLN modulation, one fused QKV + MLP-in projection,
RMS-normed q/k, SDPA, and one output projection over [attention, GELU(MLP)], gated residual. Its Linears are
swapped by ``difrl.quant.quantize_module(copy, fmt, backend=...)``: 'te' (te.Linear under te.autocast with the
format's recipe) and 'torch' (difrl's torch-native FP8, torch._scaled_mm with compiled activation quantization);
attention, norms and the modulation stay BF16. The adaLN modulation linear is kept in BF16: its GEMM has
M = batch = 1, below what TE's FP8 GEMMs accept.

Formats: TE fp8 (Float8CurrentScaling) and fp8_block (Float8BlockScaling) need SM >= 9.0 (Hopper); mxfp8 and
nvfp4 need SM 10.x (Blackwell); torch fp8 / fp8_row need SM >= 8.9. A backend x format the card or the
installed packages cannot run is listed with the reason.

Parity: the same block with ``backend='emulate'`` (difrl's exact pure-torch emulation, what CPU CI runs),
in fp32 on the same GPU with the same (BF16-valued) weights; relative Frobenius error and cosine of the
backend's output against it, and of both against the plain fp32 block.

Without a CUDA GPU it prints one line saying so and exits 0.
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cell, standard_args, write_block  # noqa: E402
from torch import nn

from difrl.quant import QuantizationError, quantize_module, relative_error
from difrl.quant.formats import cosine
from difrl.quant.timing import time_ms

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- gpu_lowprec:start -->", "<!-- gpu_lowprec:end -->"
COMBOS = (("te", "fp8"), ("te", "fp8_block"), ("te", "mxfp8"), ("te", "nvfp4"), ("torch", "fp8"), ("torch", "fp8_row"))
SKIP = ("ada",)  # M = batch = 1: not an FP8 GEMM shape


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class SingleStreamBlock(nn.Module):
    """FLUX-like single-stream block: x + gate * proj_out([attn(q, k, v), gelu(mlp_in(.))])."""

    def __init__(self, hidden: int = 3072, heads: int = 24, mlp_ratio: int = 4):
        super().__init__()
        self.heads, self.head_dim, self.mlp_hidden = heads, hidden // heads, hidden * mlp_ratio
        self.ada = nn.Linear(hidden, 3 * hidden)
        self.norm = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.qkv_mlp = nn.Linear(hidden, 3 * hidden + self.mlp_hidden)
        self.q_norm, self.k_norm = RMSNorm(self.head_dim), RMSNorm(self.head_dim)
        self.proj_out = nn.Linear(hidden + self.mlp_hidden, hidden)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        B, T, H = x.shape
        shift, scale, gate = self.ada(nn.functional.silu(temb)).unsqueeze(1).chunk(3, dim=-1)
        h = self.norm(x) * (1 + scale) + shift
        qkv, mlp = self.qkv_mlp(h).split([3 * H, self.mlp_hidden], dim=-1)
        q, k, v = qkv.view(B, T, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        attn = nn.functional.scaled_dot_product_attention(self.q_norm(q), self.k_norm(k), v)
        attn = attn.transpose(1, 2).reshape(B, T, H)
        return x + gate * self.proj_out(torch.cat([attn, nn.functional.gelu(mlp, approximate="tanh")], dim=-1))


def unavailable() -> str | None:
    """One line saying why nothing can be timed here, or None."""
    if not torch.cuda.is_available():
        return ("gpu_lowprec: no CUDA GPU on this machine (torch.cuda.is_available() is False); nothing to time. "
                "Run it on an NVIDIA GPU (FP8: sm >= 8.9; Transformer Engine optional: pip install 'difrl[te]').")
    return None


@torch.no_grad()
def run(tokens: int, warmup: int, repeats: int, seed: int = 0, device: str = "cuda", hidden: int = 3072,
        heads: int = 24) -> list[dict]:
    dev = torch.device(device)
    torch.manual_seed(seed)
    ref32 = SingleStreamBlock(hidden, heads).to(dev).eval()
    with torch.no_grad():  # weights on the BF16 grid, so every path sees the same values
        for p in ref32.parameters():
            p.copy_(p.bfloat16().float())
    block16 = copy.deepcopy(ref32).bfloat16()
    g = torch.Generator(device=dev).manual_seed(seed)
    x32 = torch.randn(1, tokens, hidden, device=dev, generator=g)
    temb32 = torch.randn(1, hidden, device=dev, generator=g)
    x16, temb16 = x32.bfloat16(), temb32.bfloat16()
    y32 = ref32(x32, temb32)
    y16 = block16(x16, temb16).float()
    base = statistics.median(time_ms(lambda: block16(x16, temb16), warmup, repeats, dev))
    cap = torch.cuda.get_device_capability() if dev.type == "cuda" else ("cpu", "")
    rows = [{"format": "bf16", "backend": "torch", "ms": base, "speedup": 1.0, "linears": "-",
             "err_vs_emulate": None, "cos_vs_emulate": None, "err_vs_fp32": relative_error(y32, y16),
             "emulate_err_vs_fp32": None, "note": f"sm_{cap[0]}{cap[1]}"}]
    print(f"bf16       {base:8.3f} ms   err vs fp32 {100 * rows[0]['err_vs_fp32']:.3f}%", flush=True)
    for backend, fmt in COMBOS:
        te_block = copy.deepcopy(block16)
        try:
            report = quantize_module(te_block, fmt, skip=SKIP, backend=backend)
        except QuantizationError as e:
            rows.append({"format": fmt, "backend": backend, "ms": None, "speedup": None, "linears": "-",
                         "err_vs_emulate": None, "cos_vs_emulate": None, "err_vs_fp32": None,
                         "emulate_err_vs_fp32": None, "note": str(e)})
            print(f"{backend:5s} {fmt:10s} not run: {e}", flush=True)
            continue
        emu = copy.deepcopy(ref32)
        quantize_module(emu, fmt, skip=SKIP, backend="emulate")
        y_te = te_block(x16, temb16).float()
        y_emu = emu(x32, temb32)
        del emu
        ms = statistics.median(time_ms(lambda: te_block(x16, temb16), warmup, repeats, dev))
        rows.append({"format": fmt, "backend": backend, "ms": ms, "speedup": base / ms,
                     "linears": f"{len(report.quantized)}/{len(report.rows)}",
                     "err_vs_emulate": relative_error(y_emu, y_te), "cos_vs_emulate": cosine(y_emu, y_te),
                     "err_vs_fp32": relative_error(y32, y_te), "emulate_err_vs_fp32": relative_error(y32, y_emu),
                     "note": next(iter(report.backends.values()), "")})
        r = rows[-1]
        print(f"{backend:5s} {fmt:10s} {ms:8.3f} ms  x{r['speedup']:.2f}  vs emulate {100 * r['err_vs_emulate']:.3f}% "
              f"(cos {r['cos_vs_emulate']:.5f})  vs fp32 {100 * r['err_vs_fp32']:.3f}%  "
              f"emulate vs fp32 {100 * r['emulate_err_vs_fp32']:.3f}%", flush=True)
        del te_block
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| format | backend | linears swapped | ms / forward (median) | speed-up vs BF16 | vs emulation rel. err | "
             "vs emulation cosine | rel. err vs fp32 | emulation rel. err vs fp32 | note |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        cells = [r["format"], r["backend"], r["linears"], cell(r["ms"], ".3f"), cell(r["speedup"], ".2f"),
                 cell(r["err_vs_emulate"], ".3f", 100, "%"), cell(r["cos_vs_emulate"], ".5f"),
                 cell(r["err_vs_fp32"], ".3f", 100, "%"), cell(r["emulate_err_vs_fp32"], ".3f", 100, "%"), r["note"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_markdown(rows: list[dict], command: str, tokens: int, path: Path) -> None:
    try:
        import transformer_engine
        te_version = getattr(transformer_engine, "__version__", "?")
    except Exception:  # ImportError, or a library error at import
        te_version = "not installed"

    block = "\n".join([
        BEGIN,
        "## GPU: FLUX-size block forward, BF16 vs Transformer Engine and torch-native low precision",
        "",
        f"Command: `{command}`  ",
        f"Date: {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}  ",
        f"Machine: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"Transformer Engine {te_version}",
        "",
        f"FLUX-like single-stream block (hidden 3072, 24 heads, MLP ratio 4), batch 1, {tokens} tokens, SDPA. "
        "Emulation = `difrl.quant` (backend 'emulate') in fp32 on the same GPU.",
        "",
        table(rows),
        END,
    ])
    write_block(path, BEGIN, END, block.split("\n")[1:-1])


def main(argv: list[str] | None = None) -> list[dict] | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    standard_args(ap, "1024+256 tokens and fewer repeats")
    ap.add_argument("--tokens", type=int, help="sequence length (default 4096 + 512; --quick 1024 + 256)")
    ap.add_argument("--repeats", type=int, help="timed forwards per format (default 50, --quick 10)")
    args = ap.parse_args(argv)
    why = unavailable()
    if why:
        print(why)
        return None
    tokens = args.tokens or (1024 + 256 if args.quick else 4096 + 512)
    repeats = args.repeats or (10 if args.quick else 50)
    rows = run(tokens, warmup=3 if args.quick else 10, repeats=repeats)
    print(table(rows))
    command = "python benchmarks/gpu_lowprec.py" + " ".join([""] + (argv if argv is not None else sys.argv[1:]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    if not args.no_write:
        write_markdown(rows, command.strip(), tokens, ROOT / "BENCHMARKS.md")
        print(f"table written to {ROOT / 'BENCHMARKS.md'}")
    return rows


if __name__ == "__main__":
    main()

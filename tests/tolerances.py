"""Named tolerances for the tests' float comparisons, each with the reason for its size.

    from tolerances import EXACT, FP32_REORDER
    torch.testing.assert_close(a, b, **FP32_REORDER)      # rtol / atol keywords (torch.allclose too)
    assert x == FP32_REORDER.approx(y)                     # pytest.approx(y, rel=rtol, abs=atol)

Not a test module (no test_ prefix); pytest puts tests/ on sys.path, as for conftest.py and device_strict.py.

Why a comparison is exact or not: IEEE 754 rounds + - * / and sqrt correctly, so elementwise arithmetic gives the
same bits on every CPU. What differs between CPU types (an Intel Xeon with AVX-512 against an AMD EPYC: seen, an
exact `== 0` on a log ratio failed on one and passed on the other) is the order of a reduction (sum, mean, matmul,
softmax; BLAS / oneDNN pick their blocking by instruction set and by the tensor's shape, so a batch of 4 and a batch of
8 may round one row differently) and the vectorized transcendental functions (exp, log, tanh: within an ulp or two,
not correctly rounded). Hence:

- EXACT (bitwise) when both sides are the same ops on the same inputs with the same shapes in one process (a re-run
  under the same seed, a copy, a save and load), integer-valued (counts, token ids, masks, rewards that are 0/1 or
  sums of a few such), powers of two or values on a quantization grid, or elementwise + - * / of such: a difference
  is then a bug, never rounding.
- A stated tolerance when the two sides reach the same math by different paths (two processes against one, micro-
  batches 1x8 against 8x1, a diffusers pipeline against our sampler, a closed form in float64 against a float32
  computation, a batch of 4 against a batch of 8): the size follows from float32's unit roundoff (2**-24 ~ 6e-8
  relative per op) times how many ops reorder, and is never looser than that reason supports.

A comparison's own line says which of these it is (a name from here, or a short comment); a module or a test whose
comparisons all share one reason says it once at the top.
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest


class Tolerance(Mapping):
    """rtol / atol with the reason for their size; `**tol` passes rtol= and atol= to torch.allclose and
    torch.testing.assert_close, `tol.approx(x)` is pytest.approx(x, rel=rtol, abs=atol)."""

    def __init__(self, rtol: float, atol: float, why: str):
        self.rtol, self.atol, self.why = float(rtol), float(atol), why

    def __getitem__(self, key: str) -> float:
        return {"rtol": self.rtol, "atol": self.atol}[key]

    def __iter__(self):
        return iter(("rtol", "atol"))

    def __len__(self) -> int:
        return 2

    def approx(self, expected):
        return pytest.approx(expected, rel=self.rtol, abs=self.atol)

    def __repr__(self) -> str:
        return f"Tolerance(rtol={self.rtol:g}, atol={self.atol:g}: {self.why})"


EXACT = Tolerance(0.0, 0.0, "bitwise: the same ops on the same inputs and shapes in one process (a re-run, a copy, "
                            "a save and load), or integer-valued / on a quantization grid; any difference is a bug")

FP32_REORDER = Tolerance(
    1e-5, 1e-6, "float32, the same math with its reductions in another order (another batch or micro-batch shape, "
                "two processes' all-reduce against one, another kernel): each op rounds to 6e-8 relative and a sum "
                "of up to ~100 terms of the tiny models' O(1) values drifts well under 1e-5 relative; atol 1e-6 for "
                "values that cancel to ~0")

FP32_VS_FP64 = Tolerance(
    1e-5, 1e-6, "a float32 computation against a float64 (or exact) closed form: float32 rounds each op to 6e-8 "
                "relative, and a few hundred ops on O(1) values stay well under 1e-5")

# The first on-policy micro-step's max |log pi_train - log pi_rollout| (the log of the importance ratio; 0 in exact
# arithmetic). Exact only when the same kernel recomputes the same values; the trainers recompute with another batch
# shape (the micro-batch, not the rollout batch), so float32 logits and log-softmax round apart by a few ulp of the
# log-probs. The trainers themselves stop the run above train.ratio_tol (on expm1 of this), whose defaults these are.
# Flow: per-sample Gaussian log-densities of O(1) (ulp(1) = 1.2e-7), a few ulp -> 1e-6.
FLOW_FIRST_STEP_LOG_RATIO = 1e-6
# Masked: per-token log-probs down to about -20 (ulp(16) = 1.9e-6), a few ulp -> 1e-5.
MASKED_FIRST_STEP_LOG_RATIO = 1e-5

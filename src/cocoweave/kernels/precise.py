"""exp and pow for generated kernels, as exact as torch's: libdevice's `exp` and `pow` (CUDA's expf and powf, which
torch calls) when Triton compiles. `tl.exp` and a pow through `tl.exp2`/`tl.log2` are approximate instead
(`ex2.approx.ftz`: an error growing with |x|, subnormals flushed). Under TRITON_INTERPRET=1, which cannot call
libdevice, both are numpy's float32 functions. (rsqrt needs no helper: codegen writes 1 / sqrt, both correctly
rounded, as torch's CPU kernels compute it.)
"""

from __future__ import annotations

import os

import triton
import triton.language as tl


def interpreted() -> bool:
    """Whether triton.jit makes interpreted functions now (TRITON_INTERPRET=1)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"  # pragma: no cover - Triton before 3.3


if interpreted():

    @triton.jit
    def precise_exp(x):
        """e ** x (numpy's exp in the interpreter)."""
        return tl.exp(x)

    @triton.jit
    def precise_pow(x, y):
        """x ** y in float32 like torch.pow: exp2(y * log2|x|), negated for a negative x and an odd integer y,
        NaN for a negative x and a non-integer y, 1 where y == 0 or x == 1 (numpy's exp2 and log2)."""
        r = tl.exp2(y * tl.log2(tl.abs(x)))
        whole = tl.floor(y) == y
        odd = whole & (tl.abs(y) % 2.0 == 1.0)
        r = tl.where(x < 0, tl.where(whole, tl.where(odd, -r, r), float("nan")), r)
        return tl.where((y == 0) | (x == 1), 1.0, r)

else:
    from triton.language.extra import libdevice

    @triton.jit
    def precise_exp(x):
        """e ** x: CUDA's expf (libdevice), as torch.exp."""
        return libdevice.exp(x)

    @triton.jit
    def precise_pow(x, y):
        """x ** y: CUDA's powf (libdevice), as torch.pow, special cases included."""
        return libdevice.pow(x, y)

"""bf16 GEMMs: the front-end of the packed GEMM for bf16 weights (``prepack.py`` calls it).

Two cases, both computed by the bf16 microkernels (bf16 products, fp32 accumulation):

* bf16 models: ``matmul(x_bf16, W_bf16)`` with a constant ``W``;
* the opt-in ``precision="bf16"`` mode for fp32 models (like OpenVINO's inference precision
  hint): ``matmul(x_fp32, W_fp32)`` with a constant ``W`` rounds ``W`` to bf16 at compile time
  and ``x`` to bf16 at run time (round to nearest even); inputs and outputs stay fp32.

``W`` is stored packed in pairs of ``k``, ``W_packed[N_pad / nr, K / 2, nr, 2]`` (``K``
zero-padded to even; ``N`` zero-padded and sliced off inside the kernel), whether the CPU has
AVX512-BF16's ``vdpbf16ps`` or widens bf16 to fp32 in the microkernel. Rounding both operands to
bf16 (8 significant bits) gives a relative error of about ``2**-8`` per product; the sums are
exact fp32, so a GEMM's error relative to its output scale is typically ``1e-3``-``1e-2``.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from tvm import relax
from tvm.target import Target

from ..schedules.gemm.heuristics import weight_layout
from .packed_gemm import emit_packed_gemm


def emit_bf16_gemm(builder: relax.BlockBuilder, target: Target, x: relax.Expr,
                   weight: np.ndarray, out_dtype: str, pad_rows: bool = True
                   ) -> relax.Expr | None:
    """The packed bf16 GEMM of ``x @ weight`` (``x`` fp32 or bf16), or None when ``target``
    has no bf16 kernel (nothing emitted then)."""
    k, n = weight.shape
    if weight_layout(target, "bfloat16", int(x.ty.shape.values[-2]), n, k) is None:
        return None
    if str(x.ty.dtype) != "bfloat16":
        x = builder.emit(relax.op.astype(x, "bfloat16"))
    return emit_packed_gemm(builder, target, x, weight, weight_dtype=ml_dtypes.bfloat16,
                            acc_dtype="float32", out_dtype=out_dtype, pad_rows=pad_rows)

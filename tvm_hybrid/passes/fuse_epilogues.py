"""``FuseGemmEpilogues``: group each GEMM with its epilogue chain, per the pattern registry."""

from __future__ import annotations

import tvm
from tvm import relax

from ..patterns import gemm_patterns


@tvm.transform.module_pass(opt_level=0, name="FuseGemmEpilogues")
class FuseGemmEpilogues:
    """Fuse ``matmul`` + bias/scale/activation/residual chains into one function each.

    Each group becomes a private Relax function tagged ``Composite: hybrid.matmul_<stages>``
    (constants stay in ``main`` and are passed in); legalization and FuseTIR then make it one
    PrimFunc, which the GEMM template schedules with the epilogue in
    the tile's write-back.
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return relax.transform.FuseOpsByPattern(gemm_patterns(), bind_constants=False)(mod)

"""The fused attention template's knobs and the heuristic that picks them.

Knobs: the query block (the columns of the ``K . Q^T`` register tile: queries ride in the
vector lanes), the key block (rows of scores per online-softmax step) and two register tiles
from the fp32 microkernel family of the target (``microkernels/``): ``qk`` (``mr`` keys x
``q_block`` queries, over the head channels) and ``pv`` (``mr`` queries x ``nr`` channels,
over the keys of a block).

Rules, in order:

1. The vector family is the target's best fp32 register-tile family (AVX-512, else AVX2).
2. ``q_block`` is two vectors (32 queries with AVX-512, 16 with AVX2): the ``qk`` tile's
   ``nr``; ``qk`` is the tallest such tile whose accumulators fit the register file and
   :data:`STACK_BYTES` (larger tiles are placed in heap workspace by TVM, and LLVM then stores
   the accumulators at every step: measured 2.7x slower on a BERT head).
3. ``pv`` is the best-ranked tile (the GEMM heuristic's ranking) whose ``nr`` divides the head
   dimension and ``mr`` the query block, within :data:`STACK_BYTES`.
4. ``k_block``: :data:`KEY_BLOCK` keys rounded down to a multiple of ``qk.mr``, or all of them
   (rounded up) when fewer: the scores of a block (``k_block x q_block`` fp32, 16 KiB) stay
   in L1.

No knobs (None) when the head dimension is not a whole number of vectors or the target has no
fp32 vector family: the attention then stays unfused.
"""

from __future__ import annotations

import dataclasses

from tvm.target import Target

from ...microkernels import Microkernel, best_vector_family
from ..gemm.heuristics import kernel_score
from .workload import AttentionShape

#: TVM puts a kernel's local buffers of this many bytes or more in heap workspace.
STACK_BYTES = 1024
#: Keys per online-softmax step.
KEY_BLOCK = 128


@dataclasses.dataclass(frozen=True)
class AttentionKnobs:
    """The knobs of one fused attention (module docstring)."""

    qk: Microkernel
    pv: Microkernel
    k_block: int

    @property
    def q_block(self) -> int:
        return self.qk.nr

    @property
    def key(self) -> str:
        return f"{self.qk.name}|{self.pv.name}|{self.k_block}"

    def describe(self) -> str:
        return (f"{self.qk.isa} fused attention: {self.q_block} queries x {self.k_block} keys "
                f"per step, K.Q^T on {self.qk.mr}x{self.qk.nr} tiles, P.V on "
                f"{self.pv.mr}x{self.pv.nr} tiles")

    def as_dict(self) -> dict:
        return {"template": "attention", "qk": self.qk.name, "pv": self.pv.name,
                "k_block": self.k_block}


def _fits_stack(kernel: Microkernel) -> bool:
    return kernel.mr * kernel.nr * 4 < STACK_BYTES


def choose_knobs(target: Target, shape: AttentionShape) -> AttentionKnobs | None:
    """The heuristic knobs of ``shape`` on ``target`` (module docstring), or None."""
    family = best_vector_family(target, "float32")
    if family is None:
        return None
    lanes = family.first.lanes
    if shape.head_dim % lanes:
        return None
    q_block = 2 * lanes
    qk = [k for k in family.kernels if k.nr == q_block and k.fits_registers() and _fits_stack(k)]
    pv = [k for k in family.kernels if shape.head_dim % k.nr == 0 and q_block % k.mr == 0
          and k.fits_registers() and _fits_stack(k)]
    if not qk or not pv:
        return None
    tile = max(qk, key=lambda k: k.mr)
    k_block = min(KEY_BLOCK // tile.mr, -(-shape.kv_len // tile.mr)) * tile.mr
    return AttentionKnobs(tile, max(pv, key=kernel_score), k_block)

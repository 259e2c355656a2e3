"""GEMM microkernels declared as data, one family per module, found through one registry.

A :class:`Microkernel` is a register tile (ISA, dtypes, ``mr x nr``, vector width, registers,
packed-weight layout); a :class:`Family` groups the tiles one ISA offers for one operand dtype
with the generator of their TIR tensor intrinsics. Each module of ``families/`` registers its
families when this package is imported, so a new ISA or dtype is one new module there (see the
README's "Extending" section)::

    C[mr, nr] (accumulators in registers) += sum_k A[mr, k] * B_packed[k, nr]

Selection for a GEMM shape is :func:`tvm_hybrid.schedules.gemm.heuristics.select`; the weight
layout follows from the kernel chosen (:attr:`Microkernel.weight_layout`).
"""

from __future__ import annotations

import importlib
import pkgutil

import numpy as np

from . import families as _families
from . import registry
from .kernel import Family, Microkernel, vector_tiles
from .registry import (
    all_families,
    best_vector_family,
    ensure_tensor_intrin,
    family_of,
    has_gemm_kernels,
    isa_tiers,
    microkernel_by_name,
    microkernels_for,
    register_family,
    supported_families,
    tensor_intrin,
    vector_bits,
)

for _module in pkgutil.iter_modules(_families.__path__):
    importlib.import_module(f"{_families.__name__}.{_module.name}")


def weight_pair_sum(weights) -> int:
    """``max |w[2j, n]| + |w[2j + 1, n]|`` over the pairs of adjacent ``k`` of ``weights``
    ``[K, N]`` (``K`` zero-padded to even): what decides whether a family with a
    :attr:`~.kernel.Family.pair_bound` is exact for them."""
    w = np.abs(np.asarray(weights, dtype=np.int64))
    if w.shape[0] % 2:
        w = np.concatenate([w, np.zeros((1,) + w.shape[1:], np.int64)])
    return int((w[0::2] + w[1::2]).max(initial=0))


def integer_gemm_dtype(target, weight_min: int, weight_max: int,
                       pair_sum: int | None = None) -> str | None:
    """The operand dtype of the best integer GEMM ``target`` has for these weights.

    ``"uint8"`` where the CPU has a u8 x s8 kernel exact for them: a dot product (VNNI, AMX)
    for any s8 weights, or AVX2's ``vpmaddubsw`` when their :func:`weight_pair_sum` is given
    and within its bound; else ``"int16"`` (the AVX2 s16 kernel, any 8-bit data); None when
    the target has neither.
    """
    family = best_vector_family(target, "uint8")
    exact = family is not None and (not family.pair_bound or (
        pair_sum is not None and pair_sum <= family.pair_bound))
    if microkernels_for(target, "uint8") and exact and -128 <= weight_min and weight_max <= 127:
        return "uint8"
    return "int16" if microkernels_for(target, "int16") else None


def has_integer_kernels(target) -> bool:
    """Whether ``target`` has an integer GEMM kernel of either operand dtype."""
    return bool(microkernels_for(target, "uint8") or microkernels_for(target, "int16"))


__all__ = [
    "Family",
    "Microkernel",
    "best_vector_family",
    "ensure_tensor_intrin",
    "all_families",
    "family_of",
    "has_gemm_kernels",
    "has_integer_kernels",
    "integer_gemm_dtype",
    "weight_pair_sum",
    "isa_tiers",
    "microkernel_by_name",
    "microkernels_for",
    "register_family",
    "registry",
    "supported_families",
    "tensor_intrin",
    "vector_bits",
    "vector_tiles",
]

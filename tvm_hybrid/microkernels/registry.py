"""The registry of microkernel families: what a target offers, by name, and their intrinsics.

Each module of ``microkernels/families/`` registers its :class:`~.kernel.Family` at import
(:func:`register_family`); everything else asks this module: which kernels a target has for an
operand dtype (:func:`microkernels_for`), a kernel by name (records, traces), the ISA tiers and
vector width a target has, and the TIR tensor intrinsic of a kernel (generated and registered
with ``s_tir.TensorIntrin`` once per shape).
"""

from __future__ import annotations

import functools
import inspect
import re

from tvm import s_tir
from tvm.target import Target

from ..host import target_features
from .kernel import Family, Microkernel
from .tiles import RowTail, Tail, plain_tile_functions, prefetch_fits, zero_block_functions
from .transposed_tail import per_column_fits, spread_of

_FAMILIES: dict[tuple[str, str], Family] = {}


def register_family(family: Family) -> Family:
    """Add ``family`` (named by its ``(isa, in_dtype)``) to the registry; returns it.

    Raises
    ------
    ValueError
        When the family is inconsistent: no kernels, kernels of several ISAs or dtypes, no
        generator for its kind of kernel, or a name already taken.
    """
    if not family.kernels:
        raise ValueError(f"microkernel family {family.tier} has no kernels")
    if len({(k.isa, k.in_dtype, k.features, k.per_block) for k in family.kernels}) != 1:
        raise ValueError(f"family {family.key} mixes ISAs, dtypes or kinds of kernel")
    per_block = family.first.per_block
    if (family.block_functions if per_block else family.tile_functions) is None:
        raise ValueError(f"family {family.key} has no intrinsic generator for its kernels")
    if family.key in _FAMILIES and _FAMILIES[family.key] != family:
        raise ValueError(f"a microkernel family {family.key} is already registered")
    _FAMILIES[family.key] = family
    return family


def all_families() -> list[Family]:
    """Every registered family, most preferred first."""
    return sorted(_FAMILIES.values(), key=lambda f: -f.rank)


def supported_families(target: Target, in_dtype: str) -> list[Family]:
    """The families for ``in_dtype`` operands whose features ``target`` has, best first."""
    features = target_features(target)
    return [f for f in all_families()
            if f.in_dtype == in_dtype and set(f.features) <= features]


def best_vector_family(target: Target, in_dtype: str) -> Family | None:
    """The preferred register-tile (not per-block) family of ``target`` for ``in_dtype``."""
    return next((f for f in supported_families(target, in_dtype) if not f.first.per_block),
                None)


def microkernels_for(target: Target, in_dtype: str, include_blocks: bool = True
                     ) -> list[Microkernel]:
    """The microkernels of ``target`` for GEMMs on ``in_dtype`` operands: every per-block
    family it has (AMX) first, then the tiles of its preferred vector family."""
    out: list[Microkernel] = []
    if include_blocks:
        for family in supported_families(target, in_dtype):
            if family.first.per_block:
                out += family.kernels
    vector = best_vector_family(target, in_dtype)
    return out + list(vector.kernels if vector else ())


def has_gemm_kernels(target: Target) -> bool:
    """Whether ``target`` has any microkernel at all (of any dtype)."""
    features = target_features(target)
    return any(set(f.features) <= features for f in _FAMILIES.values())


def vector_bits(target: Target) -> int:
    """The widest vector register of ``target`` any vector family uses (128 if none)."""
    features = target_features(target)
    widths = [f.first.vector_bits for f in _FAMILIES.values()
              if not f.first.per_block and set(f.features) <= features]
    return max(widths, default=128)


def isa_tiers() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The ISA tiers the families use, as ``(name, features all needed)``, oldest first."""
    tiers: dict[str, set[str]] = {}
    for family in sorted(all_families(), key=lambda f: f.rank):
        tiers.setdefault(family.tier, set()).update(family.features)
    return tuple((name, tuple(sorted(features))) for name, features in tiers.items())


def microkernel_by_name(name: str) -> Microkernel:
    """The microkernel called ``name`` (:attr:`Microkernel.name`).

    Raises
    ------
    KeyError
        When no microkernel has that name.
    """
    for family in _FAMILIES.values():
        for kernel in family.kernels:
            if kernel.name == name:
                return kernel
    raise KeyError(f"unknown microkernel {name!r}")


def family_of(kernel: Microkernel) -> Family:
    """The registered family ``kernel`` belongs to."""
    return _FAMILIES[(kernel.isa, kernel.in_dtype)]


def tensor_intrin(kernel: Microkernel, k: int, block: tuple[int, int] | None = None,
                  tail: Tail | None = None, prefetch: bool = False,
                  row_tail: RowTail | None = None) -> str:
    """Register (once) and return the name of ``kernel``'s tensor intrinsic over ``k``.

    Parameters
    ----------
    kernel
        The microkernel description.
    k
        The reduction length covered by one call (the whole ``K`` of a GEMM).
    block
        ``(mb, nb)`` for per-block kernels (AMX): the rows and columns one call covers.
    tail
        For vector tiles on packed weights whose last panel is partly used: where that panel
        starts and how many of its columns to compute (``tiles.Tail``).
    prefetch
        Prefetch the next ``k`` rows of ``B`` into L2 while computing (packed weights that
        stream from memory: ``tiles.prefetching_fma``; :func:`supports_prefetch`).
    """
    if kernel.per_block != (block is not None):
        raise ValueError(f"{kernel.name}: a block size is needed exactly for per-block kernels")
    if tail is not None and (not supports_tail(kernel) or not 0 < tail.columns < kernel.nr):
        raise ValueError(f"{kernel.name}: no tail of {tail.columns} columns")
    if tail is not None and tail.run and not transposed_fits(kernel, tail):
        raise ValueError(f"{kernel.name}: no transposed tail of {tail.columns} columns with "
                         f"{tail.run} k per vector")
    if prefetch and not supports_prefetch(kernel, k):
        raise ValueError(f"{kernel.name}: no prefetching intrinsic")
    if row_tail is not None and not row_tail_fits(kernel, row_tail):
        raise ValueError(f"{kernel.name}: no row tail of {row_tail.rows} rows")
    return _register(kernel, int(k), tuple(int(b) for b in block) if block else None, tail,
                     bool(prefetch), row_tail)


def zero_intrin(kernel: Microkernel, block: tuple[int, int]) -> str:
    """Register (once) and return the name of the intrinsic that zeroes a per-block
    ``kernel``'s ``(mb, nb)`` accumulators by writing nothing (``tiles.zero_block_functions``):
    what the template tensorizes the reduction's init with."""
    if not kernel.per_block:
        raise ValueError(f"{kernel.name}: only per-block kernels start from zero")
    return _register_zero(kernel, int(block[0]), int(block[1]))


@functools.cache
def _register_zero(kernel: Microkernel, mb: int, nb: int) -> str:
    name = f"{kernel.name}_b{mb}x{nb}_zero"
    desc, impl = zero_block_functions(kernel.acc_dtype, mb, nb)
    s_tir.TensorIntrin.register(name, desc, impl, override=True)
    return name


def supports_row_tail(kernel: Microkernel) -> bool:
    """Whether ``kernel`` has intrinsics for a last row tile of fewer rows (``tiles.RowTail``):
    a tile of the plain fp32 family."""
    return not kernel.per_block and family_of(kernel).tile_functions is plain_tile_functions


def row_tail_fits(kernel: Microkernel, row_tail: RowTail) -> bool:
    """Whether ``kernel`` runs ``row_tail`` (beside any column tail, broadcast or transposed):
    a tile of the plain fp32 family, fewer rows than the tile's."""
    return supports_row_tail(kernel) and 0 < row_tail.rows < kernel.mr


def supports_prefetch(kernel: Microkernel, k: int) -> bool:
    """Whether ``kernel`` has a prefetching intrinsic over ``k`` (``tiles.prefetching_fma``): a
    tile of the plain fp32 family whose accumulators fit its stack arrays, one set of sums
    (``tiles.prefetch_fits``)."""
    return (not kernel.per_block and family_of(kernel).tile_functions is plain_tile_functions
            and prefetch_fits(kernel, k))


def transposed_fits(kernel: Microkernel, tail: Tail) -> bool:
    """Whether ``kernel`` runs ``tail``'s transposed copy (``transposed_tail.py``): an fp32
    vector tile of the plain family whose vectors are as wide as the copy's, which lies beside
    the used columns of its panel (a per-column copy: a column per row of each group of
    ``run`` rows, and an accumulator per row and column in the registers)."""
    width = tail.run if tail.per_column else spread_of(tail.columns) * tail.run
    return (not kernel.per_block and kernel.in_dtype == "float32"
            and family_of(kernel).tile_functions is plain_tile_functions
            and tail.run >= 2 and 4 <= width <= kernel.lanes
            and (not tail.per_column or tail.columns <= tail.run
                 and per_column_fits(kernel.mr, tail.columns, kernel.num_registers))
            and width <= kernel.panel_width - tail.columns)


def supports_tail(kernel: Microkernel) -> bool:
    """Whether ``kernel``'s family generates tail intrinsics (a vector family whose
    ``tile_functions`` takes a third argument, the ``Tail``)."""
    generate = family_of(kernel).tile_functions
    if kernel.per_block or generate is None:
        return False
    try:
        return len(inspect.signature(generate).parameters) >= 3
    except (TypeError, ValueError):
        return False


@functools.cache
def _register(kernel: Microkernel, k: int, block: tuple[int, int] | None,
              tail: Tail | None = None, prefetch: bool = False,
              row_tail: RowTail | None = None) -> str:
    family = family_of(kernel)
    if block is None:
        name = (f"{kernel.name}_k{k}{tail.key if tail else ''}"
                f"{row_tail.key if row_tail else ''}{'_p' if prefetch else ''}")
        # A family without tails takes (kernel, k) only (supports_tail).
        if prefetch or row_tail is not None:
            desc, impl = family.tile_functions(kernel, k, tail, prefetch=prefetch,
                                               row_tail=row_tail)
        elif tail is None:
            desc, impl = family.tile_functions(kernel, k)
        else:
            desc, impl = family.tile_functions(kernel, k, tail)
    else:
        name = f"{kernel.name}_b{block[0]}x{block[1]}_k{k}"
        desc, impl = family.block_functions(kernel, block[0], block[1], k)
    s_tir.TensorIntrin.register(name, desc, impl, override=True)
    return name


#: How the names of all our intrinsics start (each microkernel's name does).
INTRIN_PREFIX = "hybrid_gemm_"
#: What names one of our intrinsics: kernel, block, ``K``, tail, row tail and prefetch
#: (:func:`tensor_intrin`).
INTRIN_NAME = (r"(hybrid_gemm_\w+?)(?:_b(\d+)x(\d+))?_k(\d+)(?:_t(\d+)at(\d+)(?:d(\d+)(c?))?)?"
               r"(?:_r(\d+)at(\d+))?(_p)?")


#: What names a per-block kernel's zeroing intrinsic (:func:`zero_intrin`).
ZERO_INTRIN_NAME = r"(hybrid_gemm_\w+?)_b(\d+)x(\d+)_zero"


def ensure_tensor_intrin(intrin_name: str) -> bool:
    """Register the tensor intrinsic called ``intrin_name`` if it is one of ours.

    A schedule trace names its tensor intrinsics; replaying a trace (tuning records) in a fresh
    process needs them registered first.

    Returns
    -------
    bool
        True when ``intrin_name`` is a tvm_hybrid microkernel intrinsic (now registered).
    """
    zero = re.fullmatch(ZERO_INTRIN_NAME, intrin_name)
    if zero:
        try:
            kernel = microkernel_by_name(zero.group(1))
        except KeyError:
            return False
        if not kernel.per_block:
            return False
        zero_intrin(kernel, (int(zero.group(2)), int(zero.group(3))))
        return True
    found = re.fullmatch(INTRIN_NAME, intrin_name)
    if not found:
        return False
    try:
        kernel = microkernel_by_name(found.group(1))
    except KeyError:
        return False
    block = (int(found.group(2)), int(found.group(3))) if found.group(2) else None
    if kernel.per_block != (block is not None):
        return False
    tail = Tail(int(found.group(6)), int(found.group(5)), int(found.group(7) or 0),
                bool(found.group(8))) if found.group(5) else None
    if tail is not None and (not supports_tail(kernel) or not 0 < tail.columns < kernel.nr
                             or tail.run and not transposed_fits(kernel, tail)):
        return False
    prefetch = bool(found.group(11))
    if prefetch and (block is not None or not supports_prefetch(kernel, int(found.group(4)))):
        return False
    row_tail = RowTail(int(found.group(10)), int(found.group(9))) if found.group(9) else None
    if row_tail is not None and (block is not None or not row_tail_fits(kernel, row_tail)):
        return False
    tensor_intrin(kernel, int(found.group(4)), block, tail, prefetch, row_tail)
    return True

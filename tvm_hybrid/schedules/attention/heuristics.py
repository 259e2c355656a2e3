"""The fused attention template's knobs and the heuristic that picks them.

Knobs: the query block (the columns of the ``K . Q^T`` register tile: queries ride in the
vector lanes), the key block (rows of scores per online-softmax step) and two register tiles
of the target's fp32 microkernel family (``microkernels/``: its ISA, vector width and register
file; the tile body is the family's ``broadcast_fma``): ``qk`` (``mr`` keys x ``q_block``
queries, over the head channels) and ``pv`` (``mr`` queries x ``nr`` channels, over the keys
of a block). Keys that do not fill a ``qk`` tile run on a remainder tile of the same
description (fewer rows).

Rules, in order:

1. The vector family is the target's best fp32 register-tile family (AVX-512, else AVX2).
2. ``q_block`` is four vectors (64 queries with AVX-512, 32 with AVX2): each key row loaded
   for ``K . Q^T`` serves that many queries; two when that pads fewer queries (197 tokens).
   ``qk`` is the tallest tile of that width whose accumulators fit the register file and
   stay under :data:`STACK_BYTES` (TVM keeps such local arrays on the stack). Measured on
   Zen 5 (BERT heads, s 128 and 384): 3 x 64 ran 10% faster than 4 x 32 and 6% faster than
   4 x 64 (1 KiB, in heap workspace); with AVX2, 2 x 32 and 6 x 16 within noise.
3. ``pv`` is the best-ranked tile (the GEMM heuristic's ranking; among tiles it ranks equal,
   the tallest) whose ``nr`` divides the head dimension and ``mr`` the query block, of at most
   16 accumulators (1 KiB); for a head dimension no such tile divides (15, 24, 40 with
   AVX-512), the best-ranked no wider than it (else the narrowest), the channels after its
   whole tiles on one tile of exactly the rest (the kernel's channel tail). For BERT heads:
   4 x 64 with AVX-512 (6% faster than 2 x 64; LLVM keeps its accumulators in registers though TVM
   places the array in workspace, which the assembly test checks), 4 x 16 with AVX2, where the
   GEMM ranking ties it with 2 x 32 and prefers the wider (a GEMM's ``B`` panel): in ``P . V``
   the taller tile loads fewer rows of ``V`` per key, and on a Zen 3 (2 cores, same process)
   BERT heads ran 4-6% faster at batch 1 (s 128, 384), 7-8% at b32 s384 and 18-21% at b32 s128
   and b8 s512 (16 heads) than on 2 x 32.
4. ``k_block``: the keys split into equal blocks of at most :func:`key_block_limit` keys:
   :data:`KEY_BLOCK` with AVX-512 (the scores of a block, ``k_block x q_block`` fp32, 32 KiB,
   stay in L1), :data:`NARROW_KEY_BLOCK` with 8-lane vectors (AVX2), where a block's scores
   and its rows of ``V`` then fit in L1 together (8 + 16 KiB for BERT heads). The AVX2 code on
   a 2-core Zen 4, same process, 9 rounds, 64 keys against 128: BERT heads b1 s128 1.088x, b1
   s384 1.047x, b32 s128 1.039x, b32 s384 1.076x, b8 s512 (16 heads) 1.050x (faster in 7-9 of
   9 rounds), ViT's 197 tokens b4 1.044x and b1 within noise, BERT-base layers (b1 s128 and
   s384, b8 s128) within noise; the AVX-512 code on the same CPU 0.993-1.006x with 64 keys.
5. ``copy_heads`` (:func:`copies_heads`): where K's or V's rows lie apart (a head split read in
   place, ``[b, s, h, d]``: rows 3 KiB apart for BERT-base, 4 KiB, the L1's set stride, for 16
   heads of 64; or K transposed), one task per head copies them into consecutive rows and runs
   the head's query blocks on them, if that leaves whole tasks for every thread (as many heads
   as threads, a multiple, or four per thread) and two query blocks or more, and the copies
   (both, fp32) stay within :data:`COPY_BYTES`. Kernel alone on an Emerald Rapids (2 cores),
   against reading in place: b8 s512 16 heads 1.30x (AVX-512) and 1.39x (AVX2 code); BERT-base
   heads b8 s128 1.06x (AVX2 code 1.08x), s384 b1 1.11x and b32 1.09x; ViT's 197 tokens b2
   1.06x; a transposed K 1.05x at s512, even at s128.

No knobs (None) when the target has no fp32 vector family: the attention then stays unfused.

An int8 (QDQ) attention (``shape.quant``) runs on the target's VNNI family (``u8 x s8``,
``vpdpbusd``), else on AVX2's s16 family (``vpmaddwd``; :func:`int8_family`): the query
block as above (s16: two vectors, 16 queries: on a Zen 3, BERT heads of 384 keys ran in
2.08 ms against 3.84 ms with 32 queries, whose 48 KiB of scores leave L1; 128 keys alike),
``qk`` the tallest tile of at most :data:`INT8_ROWS` rows (keys) that
fits the registers, ``pv`` the tallest such tile whose rows (head channels) divide the head
dimension; both span the query block, and every key is one block (the kernel quantizes the
probabilities after the whole softmax). The tuner measures query blocks of one, two and four
vectors with the two tallest ``qk`` and ``pv`` tiles of each (:func:`variants`).

On CPUs with AMX (:func:`amx_int8_family`, :func:`amx_bf16_family`) int8 and bf16 attentions
run on the tile unit where :func:`amx_applies` (``quantized_kernel.py``, ``amx_kernel.py``):
blocks of 32, 64 or 128 queries (:func:`amx_query_block`), every key in one block; the tuner
measures the three blocks.

A bf16 attention (``shape.bf16``, ``precision="bf16"``) runs on the target's bf16 dot-product
family (AVX512-BF16; :func:`bf16_family`, none without it: the attention then stays fp32) with
the same structure (:func:`grouped_knobs`): two vectors of queries, tiles of at most
:data:`BF16_ROWS` rows, every key one block; tuned like the int8 knobs.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging

from tvm.target import Target

from ...host import target_features
from ...microkernels import Microkernel, best_vector_family, supported_families
from ...microkernels.kernel import STACK_BYTES
from ..gemm.heuristics import kernel_score, target_threads
from .workload import AttentionShape, row_strides

logger = logging.getLogger(__name__)

#: The most accumulator bytes a tile may have (16 zmm registers).
TILE_BYTES = 1024
#: Keys per online-softmax step with AVX-512 (rule 4).
KEY_BLOCK = 128
#: Keys per online-softmax step with 8-lane vectors (rule 4).
NARROW_KEY_BLOCK = 64
#: The most rows of an int8 attention tile (4 x 64 on AVX-512: 16 accumulators).
INT8_ROWS = 4
#: The most rows of a bf16 attention tile (8 x 32 fp32 accumulators: 1 KiB, 16 zmm).
BF16_ROWS = 8
#: Queries per task of an AMX attention (:func:`amx_query_block`; the tuner measures all).
AMX_Q_BLOCKS = (32, 64, 128)
#: Rule 5: the most bytes of one head's K and V (fp32) a task copies.
COPY_BYTES = 4 << 20
#: The most bytes of scores an AMX attention task keeps (``q_block x keys`` fp32; L2 holds them).
AMX_SCORE_BYTES = 512 * 1024


@dataclasses.dataclass(frozen=True)
class AttentionKnobs:
    """The knobs of one fused attention (module docstring)."""

    qk: Microkernel
    pv: Microkernel
    k_block: int
    #: fp32: one task per head, which copies the head's K and V into consecutive rows first
    #: (rule 5), instead of one per query block reading them in place.
    copy_heads: bool = False

    @property
    def q_block(self) -> int:
        return self.qk.nr

    @property
    def key(self) -> str:
        key = f"{self.qk.name}|{self.pv.name}|{self.k_block}"
        return f"{key}|heads" if self.copy_heads else key

    def describe(self) -> str:
        if self.qk.per_block:
            return (f"{self.qk.isa} {self.qk.in_dtype} fused attention: {self.q_block} "
                    f"queries x {self.k_block} keys, Q.K^T and P.V on 2x2 tiles of 16x16")
        return (f"{self.qk.isa} fused attention: {self.q_block} queries x {self.k_block} keys "
                f"per step, K.Q^T on {self.qk.mr}x{self.qk.nr} tiles, P.V on "
                f"{self.pv.mr}x{self.pv.nr} tiles"
                + (", K and V copied per head" if self.copy_heads else ""))

    def as_dict(self) -> dict:
        """A JSON-able form (tuning records); :func:`knobs_from_dict` reverses it."""
        return {"template": "attention", "isa": self.qk.isa, "qk": [self.qk.mr, self.qk.nr],
                "pv": [self.pv.mr, self.pv.nr], "k_block": self.k_block,
                "copy_heads": self.copy_heads}


def key_block_limit(lanes: int) -> int:
    """Rule 4: the most keys of one online-softmax step on vectors of ``lanes`` fp32."""
    return KEY_BLOCK if lanes >= 16 else NARROW_KEY_BLOCK


def register_tiles(family) -> list[Microkernel]:
    """Every fp32 tile of ``family``'s description (1, 2 or 4 vectors wide) whose accumulators
    fit its registers and :data:`TILE_BYTES`."""
    out = []
    for vectors in (1, 2, 4):
        for mr in range(1, 17):
            tile = dataclasses.replace(family.first, mr=mr, nr=vectors * family.first.lanes)
            if tile.fits_registers() and tile.mr * tile.nr * 4 <= TILE_BYTES:
                out.append(tile)
    return out


def _query_block(lanes: int, q_len: int) -> int:
    """Four vectors of queries, or two when that pads fewer."""
    return min((4 * lanes, 2 * lanes), key=lambda n: -(-q_len // n) * n)


def int8_family(target: Target):
    """The family of ``target``'s int8 attention: VNNI's ``u8 x s8``, else AVX2's s16 (a dot
    product exact for any operands: ``P`` and ``V`` are not constants, so not the
    ``vpmaddubsw`` family for bounded weights); None without AVX2."""
    family = best_vector_family(target, "uint8")
    if family is not None and not family.pair_bound and family.first.k_step == 4:
        return family
    family = best_vector_family(target, "int16")
    return family if family is not None and family.first.k_step == 2 else None


def bf16_family(target: Target):
    """The family of ``target``'s bf16 attention: one with a bf16 dot product (AVX512-BF16's
    ``vdpbf16ps``); None without (widening bf16 to fp32 would be slower than fp32 attention,
    which has no weights whose bandwidth bf16 halves)."""
    family = best_vector_family(target, "bfloat16")
    if family is None or "avx512bf16" not in family.first.features or family.first.per_block:
        return None
    return family


def amx_bf16_family(target: Target):
    """``target``'s AMX-BF16 family (``tdpbf16ps`` on tiles), or None; also None without
    AVX512-BF16, whose ``vcvtneps2bf16`` rounds the probabilities (every AMX CPU has it)."""
    if "avx512bf16" not in target_features(target):
        return None
    return next((f for f in supported_families(target, "bfloat16") if f.first.per_block),
                None)


def amx_query_block(shape: AttentionShape, threads: int) -> int:
    """The queries per task of an AMX attention: the largest of :data:`AMX_Q_BLOCKS` that
    the queries fill (rounded up to 32) while giving each thread two tasks or more, and whose
    scores (``q_block x keys`` fp32) stay within :data:`AMX_SCORE_BYTES`; else 32.

    Larger blocks convert and load fewer tiles per query: on a 2-core Emerald Rapids VM (BERT
    heads in bf16, one process) 128 queries ran 5-10% faster than 32 at b1 s384, b8 s128, b32
    s128 and b8 s512 (16 heads), and within noise at b1 s128; at ViT's 197 tokens (b8) too,
    though it pads 256 rows against 32's 224 (2.23 against 2.40 ms). int8 takes the same
    rule."""
    keys = -(-shape.kv_len // 32) * 32
    for q_block in AMX_Q_BLOCKS[::-1]:
        tasks = shape.batch * shape.heads * -(-shape.q_len // q_block)
        if (q_block <= -(-shape.q_len // 32) * 32 and tasks >= 2 * threads
                and q_block * keys * 4 <= AMX_SCORE_BYTES):
            return q_block
    return AMX_Q_BLOCKS[0]


def amx_int8_family(target: Target):
    """``target``'s AMX-INT8 family (``tdpbusd`` on tiles), or None; also None without
    AVX512-VNNI, whose ``vpdpbusd`` sums the query block (every AMX CPU has it)."""
    if "avx512vnni" not in target_features(target):
        return None
    return next((f for f in supported_families(target, "uint8") if f.first.per_block), None)


def amx_applies(shape: AttentionShape) -> bool:
    """Whether the AMX kernels compute ``shape``: the head dimension a whole number of tile
    steps of ``K`` (32 bf16, 64 bytes in int8); int8 also reads ``K``'s rows in place as
    tiles of 16, so whole 32-key blocks, not transposed."""
    if shape.quant is not None:
        return shape.head_dim % 64 == 0 and shape.kv_len % 32 == 0 and \
            shape.k_layout != "bhds"
    return shape.bf16 and shape.head_dim % 32 == 0


def amx_knobs(family, shape: AttentionShape, q_block: int = 32) -> AttentionKnobs | None:
    """The knobs of a bf16 or int8 ``shape`` on AMX ``family``'s 32 x 32 blocks: ``q_block``
    queries per task, every key in one block; None unless :func:`amx_applies`."""
    if not amx_applies(shape) or q_block % 32:
        return None
    tile = family.first
    return AttentionKnobs(dataclasses.replace(tile, nr=q_block), tile, shape.kv_len)


def bf16_attention_pays(target: Target) -> bool:
    """Whether ``precision="bf16"`` runs attention in bf16 on ``target``: where it has a bf16
    dot product (:func:`bf16_family`) that outruns its fp32 FMAs. AMD's Zen 4 and Zen 5 issue
    ``vdpbf16ps`` (two multiply-adds a lane) as fast as an FMA; Intel's cores issue it on one
    port against two for FMAs, so its bf16 peak only equals the fp32 peak (an Emerald Rapids
    measured 78 bf16 against 118 fp32 GFLOP/s a core), and bf16 attention, which adds the
    conversions and the preparation of K and V, ran at 0.69-0.87x of fp32 attention there
    (BERT heads, 16 cores): attention stays fp32 on Intel CPUs. On a Zen 4 (2 cores) bf16
    attention ran 1.21-1.46x faster than fp32 attention on the same rows. With AMX-BF16 both
    products run on the tile unit (:func:`amx_bf16_family`), whose bf16 peak is 16 times the
    fp32 FMAs' (an Emerald Rapids measured 5.9 TFLOP/s against 0.36, 2 cores)."""
    if amx_bf16_family(target) is not None:
        return True
    return bf16_family(target) is not None and str(target.attrs.get("mcpu", "")).startswith(
        "znver")


def grouped_knobs(family, shape: AttentionShape) -> AttentionKnobs | None:
    """The heuristic knobs of a bf16 ``shape`` on ``family``'s tiles (a bf16 family, also the
    widening one the tests run anywhere): two vectors of queries, the tallest tiles of at most
    :data:`BF16_ROWS` rows whose accumulators fit the registers and :data:`TILE_BYTES`
    (``pv``'s rows dividing the head dimension), every key in one block."""
    if shape.head_dim % family.first.k_step:
        return None
    tiles = [t for t in _tiles(family, 2, BF16_ROWS) if t.mr * t.nr * 4 <= TILE_BYTES]
    pv = [t for t in tiles if shape.head_dim % t.mr == 0]
    return AttentionKnobs(tiles[0], pv[0], shape.kv_len) if tiles and pv else None


def _tiles(family, vectors: int, rows: int) -> list:
    """``family``'s tiles ``vectors`` wide and at most ``rows`` tall that fit its registers,
    tallest first."""
    tiles = [dataclasses.replace(family.first, mr=mr, nr=vectors * family.first.lanes)
             for mr in range(rows, 0, -1)]
    return [t for t in tiles if t.fits_registers()]


def _int8_knobs(target: Target, shape: AttentionShape) -> AttentionKnobs | None:
    amx = amx_int8_family(target)
    if amx is not None and amx_applies(shape):  # else the vector family
        return amx_knobs(amx, shape, amx_query_block(shape, target_threads(target)))
    family = int8_family(target)
    if family is None or shape.head_dim % family.first.k_step:
        return None
    lanes = family.first.lanes
    q_block = _query_block(lanes, shape.q_len) if family.first.k_step == 4 else 2 * lanes
    tiles = [dataclasses.replace(family.first, mr=mr, nr=q_block)
             for mr in range(INT8_ROWS, 0, -1)]
    tiles = [t for t in tiles if t.fits_registers()]
    pv = [t for t in tiles if shape.head_dim % t.mr == 0]
    if not tiles or not pv:
        return None
    return AttentionKnobs(tiles[0], pv[0], shape.kv_len)


def choose_knobs(target: Target, shape: AttentionShape) -> AttentionKnobs | None:
    """The heuristic knobs of ``shape`` on ``target`` (module docstring), or None."""
    if shape.quant is not None:
        return _int8_knobs(target, shape)
    if shape.bf16:
        amx = amx_bf16_family(target)
        if amx is not None:  # the tile unit, or fp32 (Intel's vdpbf16ps is not faster)
            return amx_knobs(amx, shape, amx_query_block(shape, target_threads(target)))
        family = bf16_family(target)
        return grouped_knobs(family, shape) if family is not None else None
    family = best_vector_family(target, "float32")
    if family is None or family.first.in_dtype != "float32" or family.first.k_step != 1:
        return None
    tiles = register_tiles(family)
    q_block = _query_block(family.first.lanes, shape.q_len)
    qk = [t for t in tiles if t.nr == q_block and t.mr * t.nr * 4 < STACK_BYTES]
    pv = _pv_tiles(tiles, q_block, shape.head_dim)
    if not qk or not pv:
        return None
    blocks = -(-shape.kv_len // key_block_limit(family.first.lanes))
    return AttentionKnobs(max(qk, key=lambda t: t.mr), max(pv, key=_pv_score),
                          -(-shape.kv_len // blocks),
                          copies_heads(shape, q_block, target_threads(target)))


def rows_apart(shape: AttentionShape) -> bool:
    """Whether K's or V's rows of one head are not consecutive ``head_dim`` floats."""
    return any(row_strides(layout, shape, shape.kv_len) != (shape.head_dim, 1)
               for layout in (shape.k_layout, shape.v_layout))


def copy_fits(shape: AttentionShape) -> bool:
    """Whether one head's K and V (fp32) fit :data:`COPY_BYTES` (rule 5)."""
    return 2 * shape.kv_len * shape.head_dim * 4 <= COPY_BYTES


def copies_heads(shape: AttentionShape, q_block: int, threads: int) -> bool:
    """Rule 5: whether one task per head copies its K and V into consecutive rows."""
    heads = shape.batch * shape.heads
    return (rows_apart(shape) and shape.q_len > q_block and copy_fits(shape)
            and heads >= threads and (heads % threads == 0 or heads >= 4 * threads))


def _pv_tiles(tiles: list[Microkernel], q_block: int, head_dim: int) -> list[Microkernel]:
    """Rule 3's candidates: ``tiles`` whose rows divide the query block and whose columns
    divide the head dimension; without any, those no wider than it (whole tiles, then one of
    the remaining channels), else the narrowest (one tile of the channels alone)."""
    rows = [t for t in tiles if q_block % t.mr == 0]
    dividing = [t for t in rows if head_dim % t.nr == 0]
    narrower = [t for t in rows if t.nr <= head_dim]
    return dividing or narrower or [t for t in rows if t.nr == min(u.nr for u in rows)]


def _pv_score(tile: Microkernel) -> tuple:
    """Rule 3's ranking: the GEMM heuristic's, less its preference for wide tiles, then the
    taller tile."""
    return (*kernel_score(tile)[:2], tile.mr)


def fits(shape: AttentionShape, knobs: AttentionKnobs) -> bool:
    """Whether ``knobs`` can compute ``shape`` (the kernel covers every query and channel)."""
    qk, pv = knobs.qk, knobs.pv
    if knobs.copy_heads and (qk.per_block or shape.quant is not None or shape.bf16):
        return False  # only the fp32 kernel copies heads
    if qk.per_block or pv.per_block:
        in_dtype = "uint8" if shape.quant is not None else "bfloat16"
        return (qk.per_block and pv.per_block and qk.in_dtype == pv.in_dtype == in_dtype
                and qk.nr % 32 == 0 and amx_applies(shape) and knobs.k_block == shape.kv_len)
    if shape.bf16:
        return (qk.k_step == pv.k_step == 2 and qk.in_dtype == pv.in_dtype == "bfloat16"
                and qk.nr == pv.nr and qk.nr % qk.lanes == 0 and qk.fits_registers()
                and pv.fits_registers() and shape.head_dim % 2 == 0
                and shape.head_dim % pv.mr == 0 and knobs.k_block == shape.kv_len)
    if (qk.in_dtype == "bfloat16") != shape.bf16:
        return False
    if shape.quant is not None:
        return (qk.k_step == pv.k_step in (2, 4) and qk.nr == pv.nr and qk.nr % qk.lanes == 0
                and qk.fits_registers() and pv.fits_registers()
                and shape.head_dim % qk.k_step == 0
                and shape.head_dim % pv.mr == 0 and knobs.k_block == shape.kv_len)
    return (qk.nr % qk.lanes == 0 and pv.nr % pv.lanes == 0 and qk.fits_registers()
            and pv.fits_registers() and qk.lanes == pv.lanes
            and knobs.q_block % pv.mr == 0 and 0 < knobs.k_block <= shape.kv_len
            and (not knobs.copy_heads or copy_fits(shape)))


def _grouped_variants(family, shape: AttentionShape) -> list[AttentionKnobs]:
    """Query blocks of one, two and four vectors, each with the two tallest ``qk`` tiles and
    the two tallest ``pv`` tiles (rows dividing the head dimension) that fit the registers."""
    out = []
    for vectors in (1, 2, 4):
        tiles = _tiles(family, vectors, 2 * INT8_ROWS)
        pvs = [t for t in tiles if shape.head_dim % t.mr == 0][:2]
        out += [AttentionKnobs(qk, pv, shape.kv_len) for qk in tiles[:2] for pv in pvs]
    return out


def variants(target: Target, shape: AttentionShape) -> list[AttentionKnobs]:
    """The knob sets a tuner measures for ``shape``: the heuristic's first, then query blocks
    of two and four vectors, the two tallest ``qk`` tiles, the three best-ranked ``pv`` tiles
    and key blocks of about 64, 128 and 256 keys, all with the heuristic's ``copy_heads``, and
    where K's or V's rows lie apart the heuristic's knobs with the other (int8:
    :func:`_int8_variants`)."""
    heuristic = choose_knobs(target, shape)
    if heuristic is None:
        return []
    if heuristic.qk.per_block:
        family = amx_int8_family(target) if shape.quant is not None else amx_bf16_family(target)
        blocks = [heuristic] + [amx_knobs(family, shape, n) for n in AMX_Q_BLOCKS
                                if n < shape.q_len + 32]
        return [k for k in dict.fromkeys(blocks) if k is not None and fits(shape, k)]
    if shape.quant is not None or shape.bf16:
        family = int8_family(target) if shape.quant is not None else bf16_family(target)
        unique = list(dict.fromkeys([heuristic, *_grouped_variants(family, shape)]))
        return [k for k in unique if fits(shape, k)]
    family = best_vector_family(target, "float32")
    lanes, tiles = family.first.lanes, register_tiles(family)
    out = [heuristic]
    for q_block in (4 * lanes, 2 * lanes):
        qks = sorted((t for t in tiles if t.nr == q_block), key=lambda t: -t.mr)[:2]
        pvs = sorted(_pv_tiles(tiles, q_block, shape.head_dim), key=_pv_score,
                     reverse=True)[:3]
        for size in (64, KEY_BLOCK, 256):
            blocks = -(-shape.kv_len // size)
            k_block = -(-shape.kv_len // blocks)
            out += [AttentionKnobs(qk, pv, k_block, heuristic.copy_heads)
                    for qk in qks for pv in pvs]
    if rows_apart(shape):  # the heuristic's knobs reading K and V the other way
        out.append(dataclasses.replace(heuristic, copy_heads=not heuristic.copy_heads))
    unique = list(dict.fromkeys(out))
    return [k for k in unique if fits(shape, k)]


def knobs_from_dict(target: Target, data: dict,
                    shape: AttentionShape | None = None) -> AttentionKnobs | None:
    """The knobs :meth:`AttentionKnobs.as_dict` wrote, for ``target`` and (when given) an int8
    or bf16 ``shape``'s family (None when the family is not the one they were made for, or ``data``
    is not such a dict)."""
    amx = isinstance(data, dict) and data.get("isa") == "amx"
    if shape is not None and shape.quant is not None:
        family = amx_int8_family(target) if amx else int8_family(target)
    elif shape is not None and shape.bf16:
        family = amx_bf16_family(target) if amx else bf16_family(target)
    else:
        family = best_vector_family(target, "float32")
    if family is None or not isinstance(data, dict) or family.first.isa != data.get("isa"):
        return None
    try:
        (qk_mr, qk_nr), (pv_mr, pv_nr) = data["qk"], data["pv"]
        return AttentionKnobs(dataclasses.replace(family.first, mr=int(qk_mr), nr=int(qk_nr)),
                              dataclasses.replace(family.first, mr=int(pv_mr), nr=int(pv_nr)),
                              int(data["k_block"]), bool(data.get("copy_heads", False)))
    except (KeyError, TypeError, ValueError):  # a hand-edited or damaged record
        return None


#: Tuned knobs by workload key (``AttentionShape.key``), set while compiling with records.
_TUNED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("tuned_attention",
                                                                    default=None)


@contextlib.contextmanager
def tuned_knobs(knobs: dict[str, dict]):
    """Within the block, :func:`knobs_for` returns these knobs (``as_dict`` forms, by
    workload key) where they apply."""
    token = _TUNED.set(dict(knobs))
    try:
        yield
    finally:
        _TUNED.reset(token)


def knobs_for(target: Target, shape: AttentionShape) -> AttentionKnobs | None:
    """The tuned knobs of ``shape`` when the records in effect have some that fit, else the
    heuristic's."""
    data = (_TUNED.get() or {}).get(shape.key)
    if data is not None:
        knobs = knobs_from_dict(target, data, shape)
        if knobs is not None and fits(shape, knobs):
            return knobs
        logger.warning("tuned attention knobs %s do not apply to %s on this target; "
                       "using the heuristic's", data, shape.describe())
    return choose_knobs(target, shape)

"""Closed-form choice of the GEMM template's knobs (no search), from cache sizes and core count.

The template (``template.py``) computes ``C[b, M, N] = A[b, M, K] @ B[K, N]`` as
``mr x nr`` register tiles (a microkernel over the whole ``K``), grouped into blocks of ``mb``
tiles down ``M`` and ``nb`` tiles across ``N``. Blocks are spread over the threads; inside a
block, the loop over ``N`` tiles is outer, so one ``K x nr`` panel of ``B`` stays in L1/L2 while
every row tile of the block's ``A`` (held in L2) is multiplied with it.

The model, in the spirit of the oneDNN Graph Compiler's:

1. **Microkernel.** Among the kernels whose ``mr`` divides ``M`` and ``nr`` divides ``N`` (no
   tails), take the one with the most FMAs per load, ``(mr * nr / lanes) / (mr + nr / lanes)``,
   needing at least 8 accumulators to cover FMA latency when ``M`` allows; ties go to the
   tile of more accumulators, then to the wider tile (fewer broadcasts of ``A``).
   :func:`select` ranks a target's kernels so, for the passes that pack constant weights
   (with ``N`` padded: :func:`panel_width`; there the FMAs per load are scaled by the share
   of useful columns, ``N / N_padded``), for the template (among kernels of the packed
   width) and for the tuner.
2. **Blocks.** Over divisors ``mb`` of ``M / mr`` and ``nb`` of ``N / nr``, minimise::

       cost = (compute + 1 / (nb * nr) + 1 / (mb * mr)) / balance
              + overhead / (mb * nb * mr * nr)

   ``1 / (nb * nr) + 1 / (mb * mr)`` is memory traffic per FLOP of a block (its ``A`` and
   ``B`` are each read from memory once: square-ish blocks are best; ``A``'s share counts a
   quarter, :data:`_A_IN_L2_TRAFFIC`, where all of ``A`` stays in L2 and ``B`` streams from
   memory) and ``compute`` the FLOP's own cost in the same units (:data:`_COMPUTE`: an
   element from memory costs about as much as 20 FMAs); ``balance = blocks / (threads *
   ceil(blocks / threads))`` scales both by the share of the cores a thread split keeps busy;
   the last term charges each block's loop and thread-scheduling overhead. (Without
   ``compute`` a 196-row GEMM of 11 column tiles, 7 x 11 row tiles, took one block on one
   core: 49 x 4 rows have less traffic than 7 x 4; 268 us against 133 us for 192 rows, on a
   Zen 3.) Constraint: the ``A`` block plus one ``B`` panel fit in half of L2,
   ``(mb * mr + nr) * K * 4 <= L2 / 2``, so ``A`` is read from L2, not memory, for every
   ``N`` tile. A per-block (AMX) kernel's block accumulates in memory, so its accumulators
   are also kept to an eighth of L2, or a third of L1 for GEMMs whose ``B`` smaller blocks
   can re-read (:func:`block_accumulator_bytes`). Where ``B`` fits half of L2 (its re-reads
   hit the cache) and blocks are cheap (an accumulator on the stack), blocks that keep 90% of the
   threads busy come first, then the cost (:func:`_busy_threads_first`): 197 one-row tiles
   of a narrow ``N``, a prime, would otherwise make one block on one core.
3. **K blocks.** Where that constraint leaves one row tile per block (``K`` large) although
   ``M`` has several, every row tile reads all of ``B``: ``M / mr`` passes over the weights,
   the first from memory at the pace of one row tile's FMAs. With ``K`` split into blocks of
   :func:`k_block_size` (1 KiB of a row of ``A``), the constraint holds per ``K`` block, and
   when rule 2 then takes all of ``M`` into one block, each ``K`` block of a ``B`` panel is
   read once and multiplied with every row tile while it is in L1; the accumulators of the
   block's column of tiles stay in L1 between ``K`` blocks (the paper's batch-reduce GEMM over
   ``K`` blocks). Measured on a 2-core Zen 3 with the weights in memory, eight 52x4608x512
   GEMMs: 29.2 -> 16.4 ms; 196x4608x512: 33.6 -> 23.7 ms for four. Where the ``K``-blocked
   blocks do not cover ``M`` either (196x2304x256: 28-row blocks) the passes over ``B`` stay
   and the split measured 12.3 -> 14.0 ms: the whole ``K`` is kept. So it is for weights
   under :data:`_K_SPLIT_MIN_L2S` L2s, which the passes find in L2 or L3 anyway: Inception
   v1's and SqueezeNet's (0.2-1.3 MB) ran 4-7% slower split. An fp32 ``K`` block of a ``B``
   panel is also kept within three quarters of L1 (:func:`k_block_size`); the split then pays even
   where all of ``A`` (``M x K``) fits in L2, where over the whole ``K`` every row tile
   re-reads its panel and its rows of ``A`` from L2. On a 2-core Emerald Rapids (48 KiB L1,
   2 MiB L2), the GEMM alone, same process, 9 rounds, outputs identical: ResNet-50's 49 x
   4608 x 512 (7 x 32 tiles, ``K`` blocks of 256) 1.155x, BERT-base's FFN2 at batch 1, 128 x
   3072 x 768 (8 x 48 tiles, blocks of 192) 1.042x. (Both had kept the whole ``K`` after
   blocks of 256 on 48-column panels, 48 KiB, all of L1, lost 6-8% on that FFN2.)
4. **Prefetch.** With weights larger than L2, the first row tile to pass over a panel reads it
   from L3 or memory at their pace (a 128 x 3072 x 768 GEMM: 2.67 ms with its weights cold
   against 2.24 ms warm on a 2-core Emerald Rapids), so the 512-bit fp32 microkernel prefetches
   the next panel's lines into L2 while it computes (:func:`prefetches_weights`): 2.42 ms cold,
   and the BERT-base layer 1.09x (batch 1) and 1.07x (batch 8) faster.
5. **A from L3.** Where the weights stream (:data:`_K_SPLIT_MIN_L2S` L2s or more), rule 3 does
   not apply and rule 2's constraint leaves whole-``K`` blocks of under
   :data:`_STREAM_MIN_ROWS` rows, each block passes over all the weights: BERT-base's FFN2 at
   batch 8 (1024 x 768 x 3072) took 32-row blocks, 32 passes over 9 MiB, at the pace of L3 or
   memory. Its ``A`` is the cheap operand to re-read (``mr`` elements per ``K`` step against
   ``nr`` of ``B``, and the prefetchers follow its rows), so such a block's ``A`` may take
   :data:`_STREAM_A_L2S` L2s (read from L3 for every ``B`` panel) while one panel stays in half
   of L2 (:func:`a_from_l3_rows`). Same process, 2-core Emerald Rapids (2 MiB L2), 7 rounds,
   outputs identical, 512-bit tiles: 1024 x 768 x 3072 1.14x (256-row blocks against 32),
   784 x 768 x 3072 1.35x, 784 x 512 x 4608 1.20x, 256 x 8224 x 3072 1.31x, 1024 x 3072 x 4096
   1.29x, 512 x 512 x 4096 1.14x, 1024 x 1024 x 3072 1.03x, 1024 x 1024 x 4096 1.05x; the
   BERT-base layer at batch 8 1.029x (9 of 11 rounds), BERT-large's at batch 8 1.002x. Blocks
   of 64 rows gain nothing (2048^3: 1.0x with 256 or 512 rows; 1024 x 4096 x 1024, 128 rows:
   0.85-0.96x with more), nor did the K blocks of rule 3 in their place for 32-row blocks of
   8 x 32 tiles (1024 x 1024 x 3072 0.90-0.99x). Unmeasured on 256-bit tiles and for integer
   and bf16 kernels, which keep rule 2, and on AMD CPUs (whose L3 a core reads faster; the
   rule applies there too) and small L3s (it does not apply: :data:`_STREAM_L3_BLOCKS`).
"""

from __future__ import annotations

import dataclasses
import math

from tvm.target import Target

from ...host import CacheSizes, cache_sizes
from ...microkernels import Microkernel, microkernels_for
from ...microkernels.kernel import STACK_BYTES
from ...microkernels.transposed_tail import transposed_layout
from ...thread_pool import num_threads

# Accumulators needed to hide FMA latency: 2 FMA pipes x 4 cycles.
_MIN_ACCUMULATORS = 8
#: L1d geometry for :func:`l1_aliased`: 64-byte lines in 64 sets (32 KiB 8-way and 48 KiB
#: 12-way caches alike), 8 ways (the fewer of the two).
_LINE = 64
_L1_SETS = 64
_L1_WAYS = 8
_INPUT_BYTES = {"float32": 4, "bfloat16": 2, "int16": 2, "uint8": 1, "int8": 1}
# Rule 2 keeps the threads busy first (this share of them at least) where each has this many
# tiles (_busy_threads_first).
_BUSY_BALANCE = 0.9
_BUSY_MIN_TILES = 8
# ...and A has this many elements at least: a smaller GEMM is over before a second thread
# pays (97x1x333, 32k of A, 0.89x split; 197x1x333 1.24x).
_BUSY_MIN_A = 1 << 16
# Bytes of an accumulator element (fp32 and int32 alike).
_ACCUMULATOR_BYTES = 4
# Cost of one block's loop overhead, in units of FLOP-normalised traffic.
_BLOCK_OVERHEAD = 4.0
# Cost of one FLOP in those units (an element read from memory ~ 20 FMAs).
_COMPUTE = 0.05
# Rule 2's traffic of A where all of A fits the block budget (half of L2) and B is weights of
# at least _K_SPLIT_MIN_L2S L2s: every block after a thread's first reads A from its L2, while
# B streams from memory. Counted in full, 32 rows of A over 8224 x 1024 weights (captcha_ocr's
# classifier; 257 panels, a prime) were split into two row blocks, each thread streaming all
# 34 MB of weights, rather than into 257 panels of all 32 rows: captcha_ocr ran 1.11x faster
# with the panels on a 2-core Emerald Rapids (9 of 9 rounds, same process, outputs identical).
# With any B over half of L2 the discount also changed Inception v1 (0.99x), Inception v2 and
# SqueezeNet (1.01x), whose weights (1.4-2 MB) the threads find in cache again.
_A_IN_L2_TRAFFIC = 0.25
# A per-block (AMX) kernel accumulates its whole block in memory (stored and loaded by the
# tiles between K blocks, read by the epilogue; also zeroed by a pass of vector stores when the
# numbers below and under _BLOCK_ACCUMULATOR_L1_SHARE were measured, no longer since the tiles
# start from tilezero): the block's accumulators are kept to this share of L2.
# int8 1024^3 on a 2-core Emerald Rapids (2 MB L2): 512 x 1024 blocks (2 MB of int32) 0.755 ms;
# blocks of 64 KB to 512 KB 0.58-0.62 ms (the tuner's 40 trials).
_BLOCK_ACCUMULATOR_L2_SHARE = 1 / 8
# ...and to this share of L1 where B read once per 32-row tile is at most _BLOCK_REREADS_L2S
# L2s (block_accumulator_bytes): there the accumulators' passes (loaded and stored per K
# block, read by the epilogue) cost more than the re-reads of B that smaller blocks add.
# Same process, 2-core Emerald Rapids, 3 rounds, 16 KB blocks against L2 / 8: int8 256x768x64
# 2.06x, 256x768x256 1.40x, 224x768x512 1.25x, 224x768x768 1.12-1.16x; bf16 256x768x64 1.83x,
# 256x768x256 1.35x, 3136x64x64 1.25x. Larger GEMMs keep L2 / 8: int8 1024x1024x512 0.91x,
# 1024^3 0.91-0.94x, bf16 1024^3 0.93x, 1024x3072x768 0.67x with 16 KB blocks.
_BLOCK_ACCUMULATOR_L1_SHARE = 1 / 3
_BLOCK_REREADS_L2S = 4
# Padding M must gain this much throughput over the best exact tile (it costs a copy of x).
_PAD_GAIN = 1.25
# ...and is only worth that copy for this many output columns or more, or for fewer where the
# exact tile has under _PAD_NARROW_ROWS rows and too few accumulators (_narrow_starved).
# Same-process A/B on a 2-core Zen 5, K = 333 unless said: 197 rows and N = 9-24 ran
# 1.5-2.0x faster padded (1x32 tiles, AVX-512 and AVX2 code), 389x16x768 2.1x, 1009x16x64
# 1.7x, 61x16 1.1x (AVX2 code 0.98x), 37x24x128 0.97x; 49x16x576, whose exact tile is 7x32
# (AVX2 code: 7x8), measured 0.93x padded and is not. N <= 8 (AVX2: <= 4) on such tiles runs
# the transposed tail instead, as fast as padded or faster (197x1 7.2 against 9.9 us). Integer
# GEMMs (u8 x s8, s16) have no such copy: their 1-row tiles re-read B from L2 for every row,
# and padded ran 1.2-3.2x faster with VNNI (197x{1,4,16}x332, 197x16x4096, 61x16x2048,
# 389x8x768) and 1.2-1.6x with the AVX2 code, bit-exact.
_PAD_MIN_N = 32
_PAD_NARROW_ROWS = 4
_NARROW_PAD_DTYPES = ("float32", "uint8", "int16")
# Under this many rows the thin tile's kernel is short: the copy (a kernel of its own, a few
# microseconds) pays only where each thread's share of the weights (small M: the threads
# split N) is at least _PAD_FEW_ROWS_MIN_L2S of an L2 (it then streams from L3 or memory, where
# the thin tile's extra loads cost most). Same-process A/B, padding 7 and 13 rows to 8 and 16
# on a 2-core Zen 3 (L2 512 KiB): 0.56 of an L2 a thread 0.97x and 0.99x, 1.0 1.06-1.09x, 4-9
# L2s 1.14-1.58x, 64x64 and 256x256 weights 0.72-0.94x; 9 rows padded to 10 on a 16-core
# Emerald Rapids (L2 2 MiB), 1024x1024 weights (0.125 of an L2 a thread): 0.73x. One or two
# rows (a GEMV reads each weight once whatever the tile) are never padded: one row padded to
# two, 1-9 MiB of weights, measured 0.86-0.90x. Only fp32 GEMMs: QDQ MLPs at batch 7 (s16
# kernel, 1-2 MiB of weights a layer) measured 0.96-0.98x padded.
_PAD_MIN_M = 16
_PAD_FEW_ROWS_MIN_L2S = 0.75
_PAD_MIN_FEW_ROWS = 3
# A per-block (AMX) kernel needs whole 32-row tiles; with M padded to them it runs this many
# times as fast as the vector family's tiles on the rows it keeps, so M is padded for it
# where M * speedup >= M padded (_block_padding). Same-process A/B on a 2-core Emerald Rapids,
# M x 768 x 768 unless said, the padding kernel included, outputs bit-exact (int8) and within
# 7e-7 of the output scale (bf16) of the vector tiles': u8 x s8 M = 10, 12: 0.73x, 0.82x
# (not padded); 16: 1.04x (16 x 3072 x 768 1.41x); 17-50: 1.56-1.61x; 97-777: 1.85-2.75x
# (197 x 3072 x 768 2.28x, 197 x 768 x 3072 2.63x). bf16 (vdpbf16ps tiles) M = 1, 3: 0.57x,
# 0.89x (not padded); 7: 1.84x (7 x 3072 x 768 1.68x); 12-20: 2.96-4.88x; 97-777: 6.2-8.2x.
_BLOCK_PAD_SPEEDUP = {"uint8": 2.0, "bfloat16": 6.0}
#: Bytes of a row of ``A`` per ``K`` block (rule 3): 256 fp32, 512 bf16, 1024 int8. One ``K``
#: block of a 24- or 32-column ``B`` panel is then 24-32 KiB (fp32), about L1.
_K_BLOCK_BYTES = 1024
#: ...and, for fp32 tiles, one ``K`` block of a ``B`` panel at most this share of L1
#: (:func:`k_block_size`).
_K_BLOCK_L1_SHARE = 0.75
#: The operand types whose ``K`` blocks that share bounds (measured to gain, or not to lose).
_K_BLOCK_L1_DTYPES = frozenset({"float32"})
#: ...and ``K`` is split only for weights of at least this many L2s (rule 3).
_K_SPLIT_MIN_L2S = 4
# Rule 5: where rule 2's constraint leaves whole-``K`` blocks of under this many rows over
# weights that stream, a block's ``A`` may take this many L2s (read from L3 for each ``B``
# panel; see the module docstring for the measurements).
_STREAM_MIN_ROWS = 64
_STREAM_A_L2S = 2
# ...where the L3 holds this many such blocks (a small L3 would send them to memory).
_STREAM_L3_BLOCKS = 4


@dataclasses.dataclass(frozen=True)
class GemmShape:
    """A GEMM ``batch x (M x K) @ (K x N)``, float element size ``itemsize`` bytes."""

    batch: int
    m: int
    n: int
    k: int
    itemsize: int = 4


@dataclasses.dataclass(frozen=True)
class GemmKnobs:
    """The template's knobs: microkernel, block sizes (in tiles), loop order.

    ``order`` is ``"nm"`` (the heuristic's: N tiles outside M tiles, so one ``B`` panel stays
    in L1 while the ``A`` block streams from L2) or ``"mn"`` (M tiles outside). The number of
    parallel blocks, hence the thread split, follows from the block sizes.
    """

    kernel: Microkernel
    m_block: int
    n_block: int
    order: str = "nm"
    #: ``K`` per block of the reduction (rule 3 of the module docstring); 0: the whole ``K``.
    k_block: int = 0

    @property
    def key(self) -> str:
        """A stable string naming the knobs (tuning records, repeats)."""
        key = f"{self.kernel.name}/{self.m_block}/{self.n_block}/{self.order}"
        return f"{key}/k{self.k_block}" if self.k_block else key

    def describe(self) -> str:
        k = self.kernel
        text = (f"{k.isa} {k.mr}x{k.nr} microkernel, blocks of {self.m_block * k.mr}x"
                f"{self.n_block * k.nr}, order {self.order}")
        return f"{text}, K blocks of {self.k_block}" if self.k_block else text

    def as_dict(self) -> dict:
        """A JSON-able form (kernel by name); the template's ``knobs_from_dict`` reverses it."""
        return {"template": "gemm", "kernel": self.kernel.name, "m_block": self.m_block,
                "n_block": self.n_block, "order": self.order, "k_block": self.k_block}


def select(target: Target, in_dtype: str, shape: GemmShape, *, panel: int | None = None,
           packing: bool = False) -> list[Microkernel]:
    """The microkernels of ``target`` that compute ``shape``, best first (rule 1's ranking).

    The one place a GEMM's kernel, hence its weight layout, is chosen: by the prepacking passes
    (``packing=True``: ``N`` and ``K`` will be padded to the kernel's layout, so only ``mr``
    must divide ``M``), by the template and by the tuner (``panel``: the width the weights were
    packed with). A per-block (AMX) kernel's padding is to whole tiles (:func:`padded_nk`),
    taken where the kept share pays for it (:func:`block_padding_pays`).
    """
    out = []
    for kernel in microkernels_for(target, in_dtype):
        if panel is not None and kernel.panel_width != panel:
            continue
        if shape.m % kernel.mr:
            continue
        whole_k = shape.k % kernel.k_granule == 0
        if shape.n % kernel.nr or not whole_k:
            # padded by the packing: a per-block kernel's N only, where that pays
            if not packing or (kernel.per_block
                               and not (whole_k and block_padding_pays(kernel, shape))):
                continue
        if not kernel.takes_columns(shape.n):
            continue
        out.append(kernel)
    # Tiles whose rows of A share an L1 set beyond its ways rank last (see l1_aliased).
    if packing:  # N padded to whole panels: a tile's throughput counts its useful columns only
        return sorted(out, key=lambda k: (not l1_aliased(k, shape), padded_throughput(k, shape.n),
                                          kernel_score(k)), reverse=True)
    return sorted(out, key=lambda k: (not l1_aliased(k, shape), *kernel_score(k)), reverse=True)


def padded_nk(kernel: Microkernel, n: int, k: int) -> tuple[int, int]:
    """``(N, K)`` as the packing pads them for ``kernel``: ``N`` to whole panels (a per-block
    kernel's: whole tiles, :func:`block_padding_pays`), ``K`` to whole ``K`` groups (``x``
    padded with zero columns too; a per-block kernel takes whole tile steps only)."""
    columns = kernel.nr if kernel.per_block else kernel.panel_width
    return -(-n // columns) * columns, -(-k // kernel.k_step) * kernel.k_step


def block_padding_pays(kernel: Microkernel, shape: GemmShape, rows: int | None = None) -> bool:
    """Whether a per-block (AMX) ``kernel`` takes ``shape`` with ``M`` padded to ``rows`` rows
    (``M`` by default) and ``N`` to whole tiles (:func:`padded_nk`): where its speed on the
    work kept (:data:`_BLOCK_PAD_SPEEDUP`) pays for the padded share of the work. ``K`` is
    not padded: AMX on small ``K`` is bound by its accumulators' traffic, not its products
    (u8 x s8 256x768x40 on 64-deep tiles ran 0.85x VNNI's time, bf16 3136x16x16 on 32x32
    tiles 0.81x, 2-core Emerald Rapids).

    Same process there, bit-exact (int8), ``N`` padded against the vector tiles: u8 x s8
    64x48x768 1.56x, 256x40x768 1.98x, 197x1000x768 2.43x, 64x16x768 1.03x; bf16 64x40x128
    1.53x, 256x1000x128 5.86x."""
    n, _ = padded_nk(kernel, shape.n, shape.k)
    kept = shape.m * shape.n * _BLOCK_PAD_SPEEDUP.get(kernel.in_dtype, 0.0)
    return kept >= (rows or shape.m) * n


def l1_aliased(kernel: Microkernel, shape: GemmShape) -> bool:
    """Whether the ``mr`` rows of ``A`` a vector tile reads at each ``k`` fall into more lines
    of one L1 set than it has ways: ``A`` rows ``K * itemsize`` bytes apart, a multiple of
    4 KiB (K = 1024, 2048, 3072 fp32), all map to one set, and a 14-row tile then misses L1 on
    every row (measured on Zen 4, 2 cores: 196x1024x256 at 159 GFLOP/s with 14x32, 202 with
    7x32; 384x3072x768 193 with 12x32, 219 with 8x32). Per-block kernels (AMX) load whole
    tiles and are not affected. The row's bytes follow the kernel's input type (the packing
    passes rank with an fp32-sized ``GemmShape``)."""
    row_bytes = shape.k * _INPUT_BYTES.get(kernel.in_dtype, 4)
    if kernel.per_block or row_bytes % _LINE:
        return False
    sets = _L1_SETS // math.gcd(row_bytes // _LINE, _L1_SETS)
    return -(-kernel.mr // sets) > _L1_WAYS


def padded_throughput(kernel: Microkernel, n: int) -> float:
    """:func:`tile_throughput` times the useful share of the columns once ``N`` is padded to
    whole panels: 32 columns on 24-wide panels compute 48, so a 4x24 tile does a third of its work
    on zeros and a 2x32 or 4x16 tile is faster."""
    cols = -(-n // kernel.panel_width) * kernel.panel_width
    return tile_throughput(kernel) * n / cols


def padded_rows(target: Target, in_dtype: str, shape: GemmShape,
                caches: CacheSizes | None = None, threads: int | None = None) -> int:
    """Zero rows to add to ``M`` so that a better register tile covers it (0: none).

    A GEMM whose ``M`` no good tile divides (197 tokens, a prime batch) would run on a thin
    tile; the packing passes can pad ``x`` with zero rows instead (sliced off in the kernel,
    like the padded columns). A per-block (AMX) kernel comes first: ``M`` is padded to its
    32-row tiles where it then takes the GEMM and the kept rows pay for the others
    (:func:`_block_padding`). Otherwise padding is chosen when the best tile's throughput,
    scaled by the useful fraction ``M / (M + pad)`` (and by its useful columns,
    :func:`padded_throughput`), beats the best exact tile by :data:`_PAD_GAIN`, and only
    for ``N >= ``:data:`_PAD_MIN_N` (the padded copy of ``x`` is paid once per ``N``), or for
    a narrower ``N`` whose exact tile is thin and starved (:func:`_narrow_starved`); under
    :data:`_PAD_MIN_M` rows, only where each of ``threads`` (:func:`target_threads` by default)
    has at least :data:`_PAD_FEW_ROWS_MIN_L2S` of an L2 of weights (``caches``: this host's by
    default), never under :data:`_PAD_MIN_FEW_ROWS` rows, and for fp32 ``x`` only.

    From :data:`_PAD_MIN_M` rows on, where the tiles alone do not decide it, each tile's
    throughput is also scaled by the share of the threads its blocks keep busy
    (:func:`thread_balance`; padded tiles whose rows alias in L1 are left out): 777 rows on
    7x32 tiles make 12 blocks for 16 threads, and padded to 784 rows (14x32 tiles, 16 blocks)
    the 777x768x333 GEMM ran 1.27x faster on a 16-core Emerald Rapids (1.16x with a fresh
    input each call); on a 2-core Zen 3, 117, 255 and 405 rows of 256x256 weights padded to
    4x24 tiles ran 1.16-1.28x faster (99 rows: the same speed).
    """
    if shape.m < _PAD_MIN_FEW_ROWS:
        return 0
    blocked = _block_padding(target, in_dtype, shape)
    if blocked:
        return blocked
    if shape.n < _PAD_MIN_N and (in_dtype not in _NARROW_PAD_DTYPES
                                 or not _narrow_starved(target, in_dtype, shape)):
        return 0
    if shape.m < _PAD_MIN_M:
        if in_dtype != "float32":
            return 0
        share = shape.k * shape.n * _INPUT_BYTES[in_dtype] / (threads or target_threads(target))
        if share < _PAD_FEW_ROWS_MIN_L2S * (caches or cache_sizes()).l2:
            return 0
    exact = select(target, in_dtype, shape, packing=True)
    if exact and exact[0].per_block:
        return 0
    kernels = [k for k in microkernels_for(target, in_dtype, include_blocks=False)
               if k.takes_columns(shape.n)]

    def useful(kernel: Microkernel) -> float:  # N is padded to whole panels as well
        return padded_throughput(kernel, shape.n)

    best_rows = _best_padding(
        shape, kernels, lambda kernel, rows: useful(kernel) * shape.m / rows,
        (useful(exact[0]) if exact else 0.0) * _PAD_GAIN)
    if best_rows or not exact or shape.m < _PAD_MIN_M:
        return best_rows
    # The exact tile's blocks may leave threads idle: count the share each tile keeps busy.
    caches, threads = caches or cache_sizes(), threads or target_threads(target)

    def balanced(kernel: Microkernel, rows: int) -> float:
        return useful(kernel) * shape.m / rows * thread_balance(
            dataclasses.replace(shape, m=rows), kernel, caches, threads)

    return _best_padding(shape, [k for k in kernels if not l1_aliased(k, shape)], balanced,
                         useful(exact[0]) * _PAD_GAIN * thread_balance(
                             shape, exact[0], caches, threads))


def _block_padding(target: Target, in_dtype: str, shape: GemmShape) -> int:
    """Zero rows that let a per-block (AMX) kernel of ``target`` take ``shape`` (0: none, or
    it takes ``shape`` as it is): where the padded shape's best kernel is per-block and the
    work kept pays for the padded work (:func:`block_padding_pays`, ``N`` and ``K`` padded to
    its tiles too)."""
    for kernel in microkernels_for(target, in_dtype):
        pad = -shape.m % kernel.mr
        if not kernel.per_block or not pad or not block_padding_pays(kernel, shape,
                                                                     shape.m + pad):
            continue
        best = select(target, in_dtype, dataclasses.replace(shape, m=shape.m + pad),
                      packing=True)
        if best and best[0] == kernel:
            return pad
    return 0


def _narrow_starved(target: Target, in_dtype: str, shape: GemmShape) -> bool:
    """Whether a GEMM of fewer than :data:`_PAD_MIN_N` columns runs on a thin tile (under
    :data:`_PAD_NARROW_ROWS` rows: ``M`` prime, or two or three times a prime) of too few
    accumulators, every row re-reading ``B`` and its FMAs waiting on each other, and (fp32)
    whose panel does not hold its columns transposed (``microkernels/transposed_tail.py``:
    dot products, as fast on one row)."""
    exact = select(target, in_dtype, shape, packing=True)
    if not exact or exact[0].per_block:
        return False
    kernel = exact[0]
    if kernel.mr >= _PAD_NARROW_ROWS or \
            kernel.mr * kernel.nr // kernel.lanes >= _MIN_ACCUMULATORS:
        return False
    columns = shape.n % kernel.panel_width
    return kernel.in_dtype != "float32" or not columns or transposed_layout(
        kernel.lanes, kernel.panel_width, columns) is None


def _best_padding(shape: GemmShape, kernels: list[Microkernel], value, threshold: float) -> int:
    """The zero rows (0: none) padding ``shape`` for the kernel whose ``value(kernel, padded
    rows)`` is the highest above ``threshold``, among those that need padding."""
    best_rows, best = 0, threshold
    for kernel in kernels:
        pad = -shape.m % kernel.mr
        if pad and (gain := value(kernel, shape.m + pad)) > best:
            best_rows, best = pad, gain
    return best_rows


def thread_balance(shape: GemmShape, kernel: Microkernel, caches: CacheSizes,
                   threads: int) -> float:
    """The share of ``threads`` that the blocks for ``kernel`` (:func:`choose_blocks`: rule 2,
    or 5) keep busy: ``blocks / (threads * ceil(blocks / threads))``, ``N`` padded to whole
    tiles (777 rows on 7x32 tiles make 12 blocks for 16 threads: 0.75)."""
    n = -(-shape.n // kernel.nr) * kernel.nr
    tiled = dataclasses.replace(shape, n=n)
    m_block, n_block = choose_blocks(tiled, kernel, caches, threads)
    return _balance(shape.batch * (shape.m // kernel.mr // m_block) * (n // kernel.nr // n_block),
                    threads)


def _balance(blocks: int, threads: int) -> float:
    """The share of ``threads`` busy when ``blocks`` equal blocks are spread over them."""
    return blocks / (threads * math.ceil(blocks / threads))


def target_threads(target: Target) -> int:
    """The threads kernels for ``target`` run on: its ``num-cores``, else TVM's pool."""
    return int(target.attrs.get("num-cores", 0)) or num_threads()


def tile_throughput(k: Microkernel) -> float:
    """Rule 1's ranking as one number: FMAs per load, discounted below 8 accumulators."""
    vectors = k.nr // k.lanes
    accumulators = k.mr * vectors
    return min(accumulators, _MIN_ACCUMULATORS) / _MIN_ACCUMULATORS * accumulators / (
        k.mr + vectors)


def choose_kernel(shape: GemmShape, kernels: list[Microkernel]) -> Microkernel | None:
    """The microkernel for ``shape`` (rule 1 of the module docstring; tiles whose rows alias
    in L1 last, :func:`l1_aliased`), or None if none fits."""
    fitting = [k for k in kernels if shape.m % k.mr == 0 and shape.n % k.nr == 0]
    if not fitting:
        return None
    return max(fitting, key=lambda k: (not l1_aliased(k, shape), *kernel_score(k)))


def kernel_score(k: Microkernel) -> tuple:
    """Rule 1's ranking: enough accumulators, then FMAs per load, then more accumulators, then
    the wider tile. (AVX2's 3x24 and 6x16 tiles tie on FMAs per load; 6x16's 12 accumulators
    against 9 ran 1.02-1.16x faster on a 2-core Zen 3, e.g. 198x768x333 and 30x3072x768.)"""
    vectors = k.nr // k.lanes
    accumulators = k.mr * vectors
    return (min(accumulators, _MIN_ACCUMULATORS), accumulators / (k.mr + vectors), accumulators,
            k.nr)


def weight_layout(target: Target, in_dtype: str, m: int, n: int, k: int
                  ) -> tuple[int, int] | None:
    """``(panel, group)`` to pack constant ``B`` of an ``m x n x k`` GEMM with, or None if no
    kernel: the layout of the best kernel :func:`select` offers with ``N`` and ``K`` padded by
    the packing (AMX's 16-column panels when the target has it and the shape is a whole number
    of AMX tiles, else the best vector tile whose ``mr`` divides ``m``)."""
    kernel = packing_kernel(target, in_dtype, m, n, k)
    return kernel.weight_layout if kernel else None


def packing_kernel(target: Target, in_dtype: str, m: int, n: int, k: int
                   ) -> Microkernel | None:
    """The kernel whose layout :func:`weight_layout` packs ``B`` in (the tile expected to
    run), or None."""
    kernels = select(target, in_dtype, GemmShape(1, m, n, k), packing=True)
    return kernels[0] if kernels else None


def panel_width(target: Target, in_dtype: str, m: int, n: int, k: int) -> int | None:
    """The panel of :func:`weight_layout` (fp32 packing has no ``k`` group)."""
    layout = weight_layout(target, in_dtype, m, n, k)
    return layout[0] if layout else None


def streams_weights(shape: GemmShape, kernel: Microkernel, caches: CacheSizes) -> bool:
    """Whether ``B`` (in ``kernel``'s input type) is at least :data:`_K_SPLIT_MIN_L2S` L2s,
    so that it streams from memory on every pass (rules 2 and 3)."""
    return shape.k * shape.n * _INPUT_BYTES.get(kernel.in_dtype, 4) \
        >= _K_SPLIT_MIN_L2S * caches.l2


def choose_blocks(shape: GemmShape, kernel: Microkernel, caches: CacheSizes,
                  threads: int, *, l3_rows: bool = True) -> tuple[int, int]:
    """``(m_block, n_block)`` in tiles (rule 2 of the module docstring; with ``l3_rows``, rule
    5's larger blocks where it applies)."""
    m_tiles, n_tiles = shape.m // kernel.mr, shape.n // kernel.nr
    budget = caches.l2 // 2
    a_in_l2 = (shape.m * shape.k * shape.itemsize <= budget
               and streams_weights(shape, kernel, caches))
    a_traffic = _A_IN_L2_TRAFFIC if a_in_l2 else 1.0
    a_from_l3 = a_from_l3_rows(shape, kernel, caches) if l3_rows else 0
    best, best_cost, best_balance = (1, 1), math.inf, 0.0
    busy, busy_cost = (1, 1), math.inf
    for mb in _divisors(m_tiles):
        rows_fit = mb * kernel.mr <= a_from_l3 if a_from_l3 else \
            mb == 1 or _a_and_panel_fit(shape, kernel, mb * kernel.mr, budget)
        if not rows_fit:
            continue
        for nb in _divisors(n_tiles):
            if (kernel.per_block and (mb, nb) != (1, 1) and mb * kernel.mr * nb * kernel.nr * 4
                    > block_accumulator_bytes(shape, kernel, caches)):
                continue
            blocks = shape.batch * (m_tiles // mb) * (n_tiles // nb)
            balance = _balance(blocks, threads)
            rows, cols = mb * kernel.mr, nb * kernel.nr
            cost = (_COMPUTE + a_traffic / cols + 1 / rows) / balance \
                + _BLOCK_OVERHEAD / (rows * cols)
            if cost < best_cost - 1e-12:
                best, best_cost, best_balance = (mb, nb), cost, balance
            if balance >= _BUSY_BALANCE and cost < busy_cost - 1e-12:
                busy, busy_cost = (mb, nb), cost
    if best_balance < _BUSY_BALANCE and busy_cost < math.inf \
            and _busy_threads_first(shape, kernel, caches, threads):
        return busy
    return best


def _a_and_panel_fit(shape: GemmShape, kernel: Microkernel, rows: int, budget: int) -> bool:
    """Rule 2's constraint: ``rows`` of ``A`` and one ``B`` panel, whole ``K``, in ``budget``
    bytes."""
    return (rows + kernel.nr) * shape.k * shape.itemsize <= budget


def _l2_rows(shape: GemmShape, kernel: Microkernel, caches: CacheSizes) -> int:
    """The most rows of a whole-``K`` block that rule 2's constraint allows in half of L2, in
    whole row tiles dividing ``M`` (one tile at least)."""
    fitting = [mb * kernel.mr for mb in _divisors(shape.m // kernel.mr)
               if _a_and_panel_fit(shape, kernel, mb * kernel.mr, caches.l2 // 2)]
    return max(fitting, default=kernel.mr)


def a_from_l3_rows(shape: GemmShape, kernel: Microkernel, caches: CacheSizes) -> int:
    """The most rows of a block that reads ``A`` from L3 (rule 5 of the module docstring), or
    0 where rule 2's constraint stands: 512-bit fp32 vector tiles over weights that stream
    (:func:`streams_weights`) where that constraint leaves blocks of under
    :data:`_STREAM_MIN_ROWS` rows (``K`` large) although ``M`` has more. Such a block's ``A``
    may then take :data:`_STREAM_A_L2S` L2s, with one ``B`` panel in half of L2, where the L3
    holds :data:`_STREAM_L3_BLOCKS` such blocks (else they would come from memory)."""
    if (kernel.in_dtype != "float32" or kernel.vector_bits != 512 or kernel.per_block
            or _STREAM_A_L2S * caches.l2 * _STREAM_L3_BLOCKS > caches.l3
            or not streams_weights(shape, kernel, caches)
            or kernel.nr * shape.k * shape.itemsize > caches.l2 // 2):
        return 0
    rows = _l2_rows(shape, kernel, caches)
    if rows >= _STREAM_MIN_ROWS or rows >= shape.m:
        return 0
    return max(rows, int(_STREAM_A_L2S * caches.l2 // (shape.k * shape.itemsize)))


def block_accumulator_bytes(shape: GemmShape, kernel: Microkernel, caches: CacheSizes) -> int:
    """The most accumulator bytes a block of a per-block (AMX) ``kernel`` may hold (rule 2):
    a third of L1 where ``B`` read once per row tile of ``kernel`` (blocks that small re-read
    it that often) is at most :data:`_BLOCK_REREADS_L2S` L2s, else an eighth of L2."""
    rereads = shape.batch * shape.m // kernel.mr * shape.k * shape.n \
        * _INPUT_BYTES.get(kernel.in_dtype, 4)
    if rereads <= _BLOCK_REREADS_L2S * caches.l2:
        return int(caches.l1d * _BLOCK_ACCUMULATOR_L1_SHARE)
    return int(caches.l2 * _BLOCK_ACCUMULATOR_L2_SHARE)


def _busy_threads_first(shape: GemmShape, kernel: Microkernel, caches: CacheSizes,
                        threads: int) -> bool:
    """Whether rule 2 keeps the threads busy (:data:`_BUSY_BALANCE` of them) before it counts
    traffic, where its cheapest blocks leave more idle: where ``B`` fits half of L2 (its re-reads
    hit the cache), each thread has :data:`_BUSY_MIN_TILES` tiles or more, ``A`` is
    :data:`_BUSY_MIN_A` elements or more, and blocks cost no allocation (:func:`stack_accumulator`).
    A prime number of row tiles otherwise makes one block (197 one-row tiles of a narrow ``N``:
    ``B`` read once, and one thread busy): 197x7x333 ran 1.40-1.63x, 197x8x333 1.67x and 197x1x333
    1.24x faster on 197 one-row blocks, 97x8x768 1.71x, 777x8x333 (37 blocks of 3 tiles before)
    1.30x, 777x32x256 1.22x; the AVX2 code 197x3x333 1.29x, 196x8x3072 1.11x, 7x1000x64 1.10x,
    49x1000x64 1.06x, 196x16x333 1.05x, 49x32x3072 1.01x (same process, 2-core Zen 4, 11 rounds,
    outputs identical; GEMMs of one column 0.99-1.15x)."""
    tiles = shape.batch * (shape.m // kernel.mr) * (shape.n // kernel.nr)
    return (stack_accumulator(kernel) and tiles >= _BUSY_MIN_TILES * threads
            and shape.batch * shape.m * shape.k >= _BUSY_MIN_A
            and shape.k * shape.n * shape.itemsize <= caches.l2 // 2)


def prefetches_weights(shape: GemmShape, kernel: Microkernel, caches: CacheSizes) -> bool:
    """Whether the microkernel prefetches the next ``K`` rows of its packed weights into L2
    (rule 4 of the module docstring; ``microkernels/tiles.py``: ``prefetching_fma``): fp32
    weights larger than L2 (they cannot be in it when the GEMM starts; in a model the other
    layers' weights pass through the caches in between) on 512-bit tiles. BERT-base's layer
    gained more so than with weights of 4 L2s or more only (its FFN): 1.088x against 1.049x
    at batch 1, 1.068x against 1.038x at batch 8 (2-core Emerald Rapids, same process, 9
    rounds). The AVX2 code (3 loads of ``B`` per 12 FMAs) ran 0.92-0.97x as fast with it."""
    return (kernel.in_dtype == "float32" and kernel.vector_bits == 512
            and not kernel.per_block and shape.k * shape.n * 4 >= caches.l2)


def stack_accumulator(kernel: Microkernel, k_block: int = 0) -> bool:
    """Whether the template keeps ``kernel``'s accumulator tile on the stack
    (``schedules/accumulate.py``: ``keep_accumulator_on_stack``): a vector tile, whole ``K``,
    under :data:`STACK_BYTES`."""
    return (not kernel.per_block and not k_block
            and kernel.mr * kernel.nr * _ACCUMULATOR_BYTES < STACK_BYTES)


def k_block_size(shape: GemmShape, kernel: Microkernel, caches: CacheSizes) -> int:
    """The ``K`` per block when the reduction is split (rule 3): the largest divisor of ``K``
    that is a whole number of the kernel's ``K`` groups, at most :data:`_K_BLOCK_BYTES` of a
    row of ``A`` and, for fp32 tiles, at most :data:`_K_BLOCK_L1_SHARE` of ``caches``' L1 for
    one block of a ``B`` panel, if at least half the lesser bound; else 0 (``K`` small, or no
    such divisor: whole ``K``). Per-block kernels (AMX) take the whole ``K``.

    The panel's block is multiplied with every row tile of a block while it stays in L1; one
    that fills L1 is evicted by the rows of ``A`` and re-read from L2. With a 48 KiB L1, 8 x 48
    tiles (48-column panels) over 3072 x 768 weights, same process on a 2-core Emerald Rapids,
    9 rounds, against ``K`` blocks of 256 (48 KiB of the panel): 192 (36 KiB) 1.033x for 256
    rows, 1.015x for 512; against the whole ``K``, 1.042x for 128 rows. 32-column panels keep
    256 (32 KiB); a 32 KiB L1 keeps 256 for AVX2's 24-column panels. On a 2-core Zen 4 (32 KiB
    L1), where 48-column panels take 128, same process, 11 rounds, against 256: the BERT-base
    layer b1 1.005x, 128x3072x768 1.035x, 128x768x3072 0.98x.

    Integer and bf16 tiles keep the row bound alone: on that Zen 4 the L1 bound's smaller
    blocks lost, same process, 11 rounds, outputs identical: VNNI u8 on 32-column panels, 512
    against 1024 (32 KiB), 0.96x for 512x1024x4096 (10 of 11 rounds), 0.98-0.99x for 128 and
    256 rows; bf16 512x1024x4096, 256 against the whole ``K``, 0.96x (10/11), the BERT-base
    layer b8 and 128x768x3072 the same speed."""
    itemsize = _INPUT_BYTES.get(kernel.in_dtype, 4)
    most = _K_BLOCK_BYTES // itemsize
    if kernel.in_dtype in _K_BLOCK_L1_DTYPES:
        most = min(most, int(caches.l1d * _K_BLOCK_L1_SHARE) // (kernel.panel_width * itemsize))
    if kernel.per_block or shape.k <= most:
        return 0
    granule = kernel.k_granule
    for size in range(most - most % granule, most // 2 - 1, -granule):
        if size and shape.k % size == 0:
            return size
    return 0


def k_split_blocks(shape: GemmShape, kernel: Microkernel, caches: CacheSizes,
                   threads: int) -> tuple[int, int, int] | None:
    """Rule 3's ``(m_block, n_block, k_block)`` where it applies: ``B`` is at least
    :data:`_K_SPLIT_MIN_L2S` L2s, the whole-``K`` block holds fewer rows than ``M``, and with
    ``K`` blocks one block holds all of ``M`` (each ``B`` panel is then read once for every
    row tile); else None."""
    m_block, _ = choose_blocks(shape, kernel, caches, threads, l3_rows=False)
    k_block = k_block_size(shape, kernel, caches)
    if not (k_block and streams_weights(shape, kernel, caches) and m_block * kernel.mr < shape.m):
        return None
    split_m, split_n = choose_blocks(dataclasses.replace(shape, k=k_block), kernel, caches,
                                     threads, l3_rows=False)
    return (split_m, split_n, k_block) if split_m * kernel.mr == shape.m else None


def kernel_knobs(shape: GemmShape, kernel: Microkernel, caches: CacheSizes, threads: int,
                 order: str = "nm") -> GemmKnobs:
    """``kernel``'s knobs for ``shape``: rule 3's blocks with its ``K`` blocks
    (:func:`k_split_blocks`) where they apply, else rule 2's blocks over the whole ``K``."""
    split = k_split_blocks(shape, kernel, caches, threads)
    if split is not None:
        return GemmKnobs(kernel, split[0], split[1], order, split[2])
    m_block, n_block = choose_blocks(shape, kernel, caches, threads)
    return GemmKnobs(kernel, m_block, n_block, order)


def choose_knobs(shape: GemmShape, kernels: list[Microkernel], caches: CacheSizes,
                 threads: int) -> GemmKnobs | None:
    """All knobs for ``shape``, or None when no microkernel tiles it without tails."""
    kernel = choose_kernel(shape, kernels)
    return None if kernel is None else kernel_knobs(shape, kernel, caches, threads)


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending: the block sizes a dimension of ``n`` tiles allows."""
    return _divisors(n)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]

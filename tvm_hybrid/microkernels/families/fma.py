"""fp32 register tiles on FMA: ``C[mr, nr] += A[mr, k] * B[k, nr]`` with broadcast ``A``.

Per ``k`` and row, one element of ``A`` is broadcast and ``nr / lanes`` FMAs update the row's
accumulators with the ``B`` panel's vectors (``vfmadd231ps`` with a broadcast load).
"""

from __future__ import annotations

from ..kernel import Family, vector_tiles
from ..registry import register_family
from ..tiles import plain_tile_functions

AVX512 = register_family(Family(
    "avx512", vector_tiles("avx512", ("avx512f",), 512, 32), rank=20,
    tile_functions=plain_tile_functions))

# With 16 registers, 3- and 4-vector tiles keep more accumulators per broadcast when M is a
# power of two: 4 x 24 ran at 100%, 2 x 32 at 90% and 4 x 16 at 80% of the FMA peak in
# registers (peak.py's kernel, Zen 5, ymm). Packed weights pad N to any width.
AVX2 = register_family(Family(
    "avx2", vector_tiles("avx2", ("avx2", "fma"), 256, 16, widths=(2, 3, 4, 1)), rank=10,
    tile_functions=plain_tile_functions))

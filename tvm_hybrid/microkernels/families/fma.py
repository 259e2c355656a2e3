"""fp32 register tiles on FMA: ``C[mr, nr] += A[mr, k] * B[k, nr]`` with broadcast ``A``.

Per ``k`` and row, one element of ``A`` is broadcast and ``nr / lanes`` FMAs update the row's
accumulators with the ``B`` panel's vectors (``vfmadd231ps`` with a broadcast load).
"""

from __future__ import annotations

from ..kernel import Family, vector_tiles
from ..registry import register_family
from ..tiles import plain_tile_functions

# 3-vector (48-column) tiles hold up to 27 accumulators for 12 loads per k, against 2-vector
# tiles' 28 for 16 (14x32) or 16 for 10 (8x32, what 1024 rows take). Where N is whole 48-column
# panels they ran faster on a 2-core Emerald Rapids VM (same process, 9 rounds): 1024x3072x768
# 1.05-1.06x, 1024x768x3072 1.02-1.13x, 128x768x768 1.05-1.08x, the BERT-base layer 1.03-1.06x
# at b8 and 1.05x at b1, yolox_captcha 1.05x. With a tail panel they lost to the 2-vector tiles
# (orientation 0.94x: 14x32 against 7x48 with a 16-column last panel), so they are taken only
# where N fills their panels (``whole_panels``).
AVX512 = register_family(Family(
    "avx512", vector_tiles("avx512", ("avx512f",), 512, 32, widths=(2, 3, 1),
                           whole_panel_widths=(3,)), rank=20,
    tile_functions=plain_tile_functions))

# With 16 registers, 3- and 4-vector tiles keep more accumulators per broadcast when M is a
# power of two: 4 x 24 ran at 100%, 2 x 32 at 90% and 4 x 16 at 80% of the FMA peak in
# registers (peak.py's kernel, Zen 5, ymm). Packed weights pad N to any width.
AVX2 = register_family(Family(
    "avx2", vector_tiles("avx2", ("avx2", "fma"), 256, 16, widths=(2, 3, 4, 1)), rank=10,
    tile_functions=plain_tile_functions))

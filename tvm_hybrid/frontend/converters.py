"""Op converters this package adds to TVM's ONNX importer, in one registry.

TVM 0.27's Relax importer looks converters up through ``onnx_frontend._get_convert_map()`` on
every node; :func:`added_converters` extends that map for the duration of one import.
"""

from __future__ import annotations

import contextlib

from tvm.relax.frontend.onnx import onnx_frontend

from .attention import CONVERTERS as ATTENTION_CONVERTERS
from .causal_conv import CONVERTERS as CAUSAL_CONV_CONVERTERS
from .clip import CONVERTERS as CLIP_CONVERTERS
from .conv_integer import CONVERTERS as CONV_INTEGER_CONVERTERS
from .linear_attention import CONVERTERS as LINEAR_ATTENTION_CONVERTERS
from .lrn import CONVERTERS as LRN_CONVERTERS
from .resize import CONVERTERS as RESIZE_CONVERTERS
from .rnn import CONVERTERS as RNN_CONVERTERS
from .rotary import CONVERTERS as ROTARY_CONVERTERS
from .silent_defaults import CONVERTERS as SILENT_DEFAULT_CONVERTERS
from .small_ops import CONVERTERS as SMALL_OP_CONVERTERS
from .spectral import CONVERTERS as SPECTRAL_CONVERTERS
from .variadic import CONVERTERS as VARIADIC_CONVERTERS

#: Op type -> ``OnnxOpConverter`` class, for ops TVM's importer lacks or imports opaquely.
CONVERTERS = {**RNN_CONVERTERS, **CONV_INTEGER_CONVERTERS, **CLIP_CONVERTERS,
              **ATTENTION_CONVERTERS, **VARIADIC_CONVERTERS, **LRN_CONVERTERS,
              **SMALL_OP_CONVERTERS, **SILENT_DEFAULT_CONVERTERS, **ROTARY_CONVERTERS,
              **SPECTRAL_CONVERTERS, **RESIZE_CONVERTERS, **CAUSAL_CONV_CONVERTERS,
              **LINEAR_ATTENTION_CONVERTERS}


def convert_map() -> dict:
    """TVM's converters with ours added (ours win on a name clash)."""
    return {**_stock_convert_map(), **CONVERTERS}


def _stock_convert_map() -> dict:
    original = getattr(onnx_frontend._get_convert_map, "__wrapped__",
                       onnx_frontend._get_convert_map)
    return original()


@contextlib.contextmanager
def added_converters():
    """Make TVM's importer use :func:`convert_map` inside the block."""
    original = onnx_frontend._get_convert_map
    if getattr(original, "__wrapped__", None) is not None:  # nested or concurrent: already on
        yield
        return

    def extended() -> dict:
        return convert_map()

    extended.__wrapped__ = original
    onnx_frontend._get_convert_map = extended
    try:
        yield
    finally:
        onnx_frontend._get_convert_map = original

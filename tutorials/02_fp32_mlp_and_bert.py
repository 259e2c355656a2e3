"""
The fp32 engine: an MLP and a BERT layer
========================================

tvm_hybrid's first compile, with no tuning, runs GEMMs near the machine's fp32 peak. This
tutorial compiles the oneDNN Graph Compiler paper's MLP_2 and a BERT-base encoder layer and shows
the three things that make that happen:

1. **fusion**: each GEMM and its epilogue (bias, GELU, residual add, ...) is one kernel, grouped
   by the named patterns of ``tvm_hybrid.patterns``, and the layers of a small-batch MLP share
   one kernel (a *chain*: one parallel loop over row blocks runs every layer);
2. **prepacking**: constant weights are rewritten at compile time into the microkernel's panel
   layout, so nothing is repacked at run time;
3. **the expert template**: each GEMM kernel is a tensorized register-tile microkernel
   (``tvm_hybrid.microkernels``) inside loops whose block sizes come from a closed-form heuristic
   (``tvm_hybrid.schedules.gemm.heuristics``).

It checks every result against stock TVM and prints the speed-up.
"""

# %%
# Compile the paper's MLP_2
# -------------------------
import os
import re

import numpy as np
import tvm
from onnx import numpy_helper

import tvm_hybrid
from tvm_hybrid.bench import workloads
from tvm_hybrid.passes.packed_gemm import pack_weight
from tvm_hybrid.schedules.gemm.heuristics import panel_width

mlp = workloads.mlp(32, (479, 1024, 1024, 512, 256, 1), final="Sigmoid", name="mlp2")
hybrid = tvm_hybrid.compile(mlp.model)
stock = tvm_hybrid.compile(mlp.model, pipeline="stock")
np.testing.assert_allclose(hybrid(**mlp.inputs), stock(**mlp.inputs), rtol=1e-4, atol=1e-5)

# %%
# One kernel for the five layers: at batch 32 the layers form a chain (``passes/gemm_chain.py``,
# the paper's coarse-grain fusion). Each thread runs all layers for its block of rows, each
# layer's bias and ReLU in its tiles' write-back, so the intermediates stay in the core's
# caches and the threads never wait for each other between layers. (The Sigmoid after the
# last layer's padded single column is a kernel of its own.)
for name in hybrid.kernel_names():
    print(name)

# %%
# The templates' choices are recorded on the loops: the chain's rows per block on its parallel
# loop, each layer's microkernel on its tile loop.
for gvar, func in hybrid.lowered.functions.items():
    if isinstance(func, tvm.tirx.PrimFunc):
        notes = re.findall(r'"hybrid.gemm_(?:chain|template)": "([^"]+)"', func.script())
        print(f"{gvar.name_hint}:", "; ".join(notes) if notes else "fallback schedule")

# %%
# ``TVM_HYBRID_GEMM_CHAINS=off`` compiles one kernel per layer instead (``all`` chains whatever
# the template can take; the default ``auto`` asks the cost model), for comparison.
os.environ["TVM_HYBRID_GEMM_CHAINS"] = "off"
per_layer = tvm_hybrid.compile(mlp.model)
del os.environ["TVM_HYBRID_GEMM_CHAINS"]
print(per_layer.kernel_names())
np.testing.assert_allclose(per_layer(**mlp.inputs), hybrid(**mlp.inputs), rtol=1e-6, atol=1e-7)

# %%
# Prepacked weights
# -----------------
# ``main`` passes constants to the kernels; the first layer's weight W[479, 1024] is now
# W_packed[1024 / nr, 479, nr]: one contiguous K x nr panel per block of nr output columns.
constants = []
tvm.relax.analysis.post_order_visit(
    hybrid.lowered["main"],
    lambda e: constants.append(e.value.numpy())
    if isinstance(e, tvm.ir.GenericConst) and hasattr(e.value, "numpy") else None,
)
print("constant shapes in main:", sorted({c.shape for c in constants}, key=len))
first_weight = numpy_helper.to_array(mlp.model.graph.initializer[0])
nr = panel_width(hybrid.target, "float32", mlp.inputs["x"].shape[0], *first_weight.shape[::-1])
if nr is not None:  # the panel width of the microkernel the heuristic picks for this M
    packed = pack_weight(first_weight, nr)
    assert any(c.shape == packed.shape and np.array_equal(c, packed) for c in constants)
    print(f"W{list(first_weight.shape)} is stored packed as {list(packed.shape)}")

# %%
# The microkernel in the assembly: FMAs on full vector registers with a broadcast of A.
asm = hybrid.inspect_source("asm")
fma = re.findall(r"vfmadd231ps\s+[^\n]+", asm)
print(len(fma), "FMA instructions, e.g.", fma[:3])

# %%
# Speed-up over stock TVM
# -----------------------
t_hybrid = hybrid.benchmark(**mlp.inputs)["median_ms"]
t_layers = per_layer.benchmark(**mlp.inputs)["median_ms"]
t_stock = stock.benchmark(**mlp.inputs, repeat=5, min_repeat_ms=1)["median_ms"]
print(f"MLP_2 b32: hybrid {t_hybrid:.3f} ms ({mlp.flops / t_hybrid / 1e6:.0f} GFLOP/s; "
      f"one kernel per layer {t_layers:.3f} ms), stock TVM {t_stock:.1f} ms: "
      f"{t_stock / t_hybrid:.0f}x")

# %%
# A BERT-base encoder layer
# -------------------------
# Q/K/V projections fuse their bias, the FFN's first GEMM fuses bias + erf-GELU, the output
# projections fuse bias + residual add; softmax and layer norm get parallel vectorised schedules.
bert = workloads.bert_layer(1, 128)
hybrid_bert = tvm_hybrid.compile(bert.model)
stock_bert = tvm_hybrid.compile(bert.model, pipeline="stock")
np.testing.assert_allclose(hybrid_bert(**bert.inputs), stock_bert(**bert.inputs), rtol=1e-4,
                           atol=1e-4)
for name in hybrid_bert.kernel_names():
    print(name)
t_hybrid = hybrid_bert.benchmark(**bert.inputs)["median_ms"]
t_stock = stock_bert.benchmark(**bert.inputs, repeat=3, min_repeat_ms=1)["median_ms"]
print(f"BERT layer b1 s128: hybrid {t_hybrid:.2f} ms, stock TVM {t_stock:.0f} ms: "
      f"{t_stock / t_hybrid:.0f}x")

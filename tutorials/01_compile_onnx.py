"""
Compile an ONNX model with tvm_hybrid
=====================================

This tutorial builds a small DLRM-style MLP as ONNX, compiles it with tvm_hybrid's hybrid
pipeline and with stock TVM, checks that both agree, and compares their speed. It then shows
the same pipeline from plain TVM code (``relax_pipeline="hybrid"``), the generated code, and
exporting the model to a shared library.
"""

# %%
# Build a model
# -------------
# ``tvm_hybrid.bench.workloads`` builds the paper's workloads as ONNX models with random weights.
# Any ``.onnx`` file path or ``onnx.ModelProto`` works the same way.
import tempfile
from pathlib import Path

import numpy as np
import tvm
from tvm import relax

import tvm_hybrid
from tvm_hybrid.bench import workloads

print(tvm_hybrid.describe_host())
wl = workloads.mlp(32, (13, 512, 256, 128), name="mlp1")
x = wl.inputs["x"]

# %%
# Compile with hybrid and with stock TVM
# --------------------------------------
# ``target="host"`` (the default) detects this CPU; TVM's thread pool uses every physical core.
hybrid = tvm_hybrid.compile(wl.model)
stock = tvm_hybrid.compile(wl.model, pipeline="stock")
y_hybrid, y_stock = hybrid(x), stock(x)
np.testing.assert_allclose(y_hybrid, y_stock, rtol=1e-4, atol=1e-4)
print("outputs agree; max abs difference", float(np.abs(y_hybrid - y_stock).max()))

t_hybrid = hybrid.benchmark(x)["median_ms"]
t_stock = stock.benchmark(x, repeat=5, min_repeat_ms=1)["median_ms"]
print(f"hybrid {t_hybrid:.3f} ms, stock TVM {t_stock:.3f} ms: {t_stock / t_hybrid:.0f}x faster")

# %%
# What ran
# --------
# One kernel per Linear layer (MatMul + bias + ReLU fused); each is parallel and vectorised.
print(hybrid.kernel_names())
tir = hybrid.inspect_source("tir")
print(tir[: tir.find("\n\n# ")] if "\n\n# " in tir else tir)

# %%
# From existing TVM code
# ----------------------
# Installing tvm_hybrid registers the "hybrid" Relax pipeline when ``tvm`` is imported.
mod = tvm_hybrid.frontend.import_model(wl.model).mod
target = tvm_hybrid.make_target("host")
ex = tvm.compile(mod, target=target, relax_pipeline="hybrid")
vm = relax.VirtualMachine(ex, tvm.cpu())
np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(x)).numpy(), y_stock, rtol=1e-4,
                           atol=1e-4)

# %%
# Export and load
# ---------------
with tempfile.TemporaryDirectory() as tmp:
    path = hybrid.export(Path(tmp) / "mlp.so")
    loaded = tvm_hybrid.load(path)
    np.testing.assert_array_equal(loaded(x), y_hybrid)
    print("exported and reloaded", path.name)

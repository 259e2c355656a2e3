"""
Why is it slow? The profile report, and the compile cache
=========================================================

``model.profile(...)`` (``tvm-hybrid profile model.onnx``) times every kernel of a compiled
model and says, per kernel, which ONNX nodes it computes, whether an expert template scheduled it
(and with which microkernel) or why none did, and how far it is from the machine's peak. This
tutorial profiles a BERT-base encoder layer, where the GEMM templates take almost all the time,
and a small CNN (SqueezeNet from ONNX's test data), whose convolutions run on the GEMM
templates while its pooling and layout changes take the generic schedule: the report shows
where the rest of the time goes. Then it compiles with a cache directory, so a
second process loads the model instead of compiling it.
"""

# %%
# A BERT layer
# ------------
import os
import tempfile
import time

import numpy as np
import onnx
import onnx.backend.test

import tvm_hybrid
from tvm_hybrid.bench import workloads

bert = workloads.bert_layer(1, 128)
model = tvm_hybrid.compile(bert.model)
report = model.profile(**bert.inputs)
print(report)

# %%
# The kernels' times add up to the model's latency, less the VM's dispatch and allocation; the
# expert templates hold most of it, each GEMM near the machine's peak.
parts = report.by_schedule()
print(f"kernels {report.kernels_ms:.3f} of {report.model_ms:.3f} ms; in templates "
      f"{100 * parts['template'] / report.kernels_ms:.0f}%")
assert all(k.info.nodes for k in report.kernels), "every kernel names its ONNX nodes"

# %%
# A CNN
# -----
# The report lists SqueezeNet's kernels slowest first, with their GFLOP/s, their share of the
# time and what scheduled them (a template and its microkernel, or why the fallback rule).
path = os.path.join(os.path.dirname(onnx.backend.test.__file__), "data", "light",
                    "light_squeezenet.onnx")
cnn = tvm_hybrid.compile(path)
rng = np.random.default_rng(0)
feeds = {s.name: rng.standard_normal(s.shape).astype(s.dtype) for s in cnn.inputs}
cnn_report = cnn.profile(**feeds, repeat=3)
for line in str(cnn_report).splitlines()[:7]:
    print(line)
print(cnn_report.summary())
out_dir = tempfile.mkdtemp()
cnn_report.to_html(os.path.join(out_dir, "squeezenet_profile.html"))
print("bar chart:", os.path.join(out_dir, "squeezenet_profile.html"))

# %%
# The compile cache
# -----------------
# With ``cache_dir`` (``--cache-dir``, or ``TVM_HYBRID_CACHE_DIR``), a compile stores the
# exported model under a key of the model's bytes, shapes, target, precision, records and
# versions; the next compile of the same model loads it (checked like any exported model).
cache = tempfile.mkdtemp()
start = time.perf_counter()
first = tvm_hybrid.compile(bert.model, cache_dir=cache)
miss = time.perf_counter() - start
start = time.perf_counter()
second = tvm_hybrid.compile(bert.model, cache_dir=cache)
hit = time.perf_counter() - start
print(f"first compile (stores it) {miss:.2f} s, second (loads it) {hit:.3f} s: "
      f"{miss / hit:.0f}x")
np.testing.assert_array_equal(first(**bert.inputs), second(**bert.inputs))

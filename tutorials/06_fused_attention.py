"""
Fused attention
===============

Multi-head attention is ``softmax(Q.K^T / sqrt(d) + mask).V`` per head. Run op by op it writes a
``seq x seq`` score matrix per head to memory, reads it back for the softmax, writes the
probabilities and reads them again for ``.V``; the head split and merge around it are copies.
tvm_hybrid rewrites the whole subgraph into one kernel (``FuseAttention``, the template in
``tvm_hybrid.schedules.attention``): per block of queries, an online softmax over blocks of keys
keeps everything in L1 and both products run on the fp32 microkernels.

This tutorial compiles a BERT-base attention and a BERT encoder layer, shows the fused kernel
and what it replaced, checks the results against the unfused graph and times both; then the
same for an int8 (QDQ) attention, a causal (GPT-style) one and the bf16 mode.
"""

# %%
# Compile BERT-base attention (12 heads of 64) over 384 tokens
# -------------------------------------------------------------
import re
import time

import numpy as np
import tvm

import tvm_hybrid
from tvm_hybrid.bench import workloads

attention = workloads.attention(1, 384)
fused = tvm_hybrid.compile(attention.model)
# The same compile with the pass disabled, the TVM way: the unfused graph.
with tvm.transform.PassContext(opt_level=3, disabled_pass=["FuseAttention"]):
    unfused = tvm_hybrid.compile(attention.model)

print("fused:  ", fused.kernel_names())
print("unfused:", unfused.kernel_names())

# %%
# The fused kernel says what the heuristic chose: query and key blocks and the register tiles of
# both products, taken from the CPU's microkernel family.
for name, info in fused.kernels.items():
    print(f"{name}: {info.schedule}, {info.detail}")
    print(f"  ONNX nodes: {', '.join(info.nodes)}")

# %%
# No score matrix: the largest buffer any kernel allocates is one block of scores.
tir = fused.inspect_source("tir")
sizes = [int(np.prod([int(v) for v in dims.split(",") if v.strip()]))
         for dims in re.findall(r"T\.alloc_buffer\(\(([\d, ]+)\)", tir)]
print(f"largest kernel buffer: {max(sizes)} floats; one head's scores: {384 * 384}")
assert max(sizes) < 384 * 384

# %%
# Same results, faster
# --------------------
a = fused(**attention.inputs)
b = unfused(**attention.inputs)
err = np.abs(a - b).max() / np.abs(b).max()
print(f"max difference relative to the output scale: {err:.1e}")
assert err < 1e-5


def median_ms(model, inputs, rounds=20):
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        model(**inputs)
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


for wl in (attention, workloads.bert_layer(1, 128)):
    one = fused if wl is attention else tvm_hybrid.compile(wl.model)
    if wl is attention:
        other = unfused
    else:
        with tvm.transform.PassContext(opt_level=3, disabled_pass=["FuseAttention"]):
            other = tvm_hybrid.compile(wl.model)
    f, u = median_ms(one, wl.inputs), median_ms(other, wl.inputs)
    print(f"{wl.name}: fused {f:.2f} ms, unfused {u:.2f} ms ({u / f:.1f}x)")

# %%
# int8 (QDQ) attention
# --------------------
# A model quantized by ONNX Runtime's QDQ quantizer wraps the attention's inputs and its
# softmax output in ``QuantizeLinear``/``DequantizeLinear``. The whole subgraph becomes the
# int8 kernel (``schedules/attention/quantized_kernel.py``): both products on VNNI's
# ``vpdpbusd`` with exact integer zero-point compensation (on AVX2-only CPUs on ``vpmaddwd``
# over s16 pairs less their zero points), the softmax in fp32, P quantized after the whole
# row; a small preparation kernel sums K's rows and packs V (or packs K and V in s16 pairs)
# once per head.
qdq = workloads.qdq_attention(1, 384)
q_fused = tvm_hybrid.compile(qdq.model)
with tvm.transform.PassContext(opt_level=3, disabled_pass=["FuseAttention"]):
    q_unfused = tvm_hybrid.compile(qdq.model)
for name, info in q_fused.kernels.items():
    if "attention" in name:
        print(f"{name}: {info.schedule}, {info.detail}")
# Against the integer reference of the kernel's arithmetic (exact products, float64 softmax):
# rows are bit-identical except where a probability lies within float rounding of a
# quantization boundary.
want, step = workloads.qdq_attention_reference(qdq)
got = q_fused(**qdq.inputs)
print(f"bit-exact rows: {np.mean(np.all(got == want, axis=-1)):.2%}, "
      f"max difference {np.abs(got - want).max() / step:.2f} probability steps")
assert np.abs(got - want).max() <= 3 * step
f, u = median_ms(q_fused, qdq.inputs), median_ms(q_unfused, qdq.inputs)
print(f"{qdq.name}: fused {f:.2f} ms, unfused {u:.2f} ms ({u / f:.1f}x)")

# %%
# Causal masks and bf16
# ---------------------
# GPT-style attention masks its scores with ``Where(causal, scores, -inf)`` before the padding
# mask; the boolean mask joins the kernel as an operand, in int8 as in fp32.
causal = workloads.qdq_attention(1, 64, heads=2, causal=True)
compiled = tvm_hybrid.compile(causal.model)
print(compiled.kernels["hybrid_attention"].detail)
want, step = workloads.qdq_attention_reference(causal)
assert np.abs(compiled(**causal.inputs) - want).max() <= 3 * step

# %%
# With ``precision="bf16"`` on an AMD CPU with AVX512-BF16 (Zen 4, Zen 5) both products run on
# ``vdpbf16ps`` (``schedules/attention/bf16_kernel.py``: bf16 operands and probabilities, fp32
# sums and softmax); on Intel CPUs with AMX on the tile unit (``amx_kernel.py``: ``tdpbf16ps``,
# the same arithmetic); without a bf16 dot product, and on Intel CPUs without AMX, whose
# ``vdpbf16ps`` is no faster than their fp32 FMAs, the attention stays fp32.
small = workloads.attention(1, 64, heads=2)
compiled = tvm_hybrid.compile(small.model, precision="bf16")
print(compiled.kernels["hybrid_attention"].detail)

"""
Low precision: int8 (QDQ, VNNI or AVX2), bf16, and AMX
======================================================

The oneDNN Graph Compiler's biggest wins come from int8. This tutorial quantizes the paper's
MLP_2 (an ONNX QDQ model, as ONNX Runtime's quantizer writes them), compiles it, and compares
accuracy and speed with fp32; then runs the fp32 model in the ``precision="bf16"`` mode; then
shows how AMX is selected.
"""

# %%
# A QDQ MLP compiled to int8
# --------------------------
# ``workloads.qdq_mlp`` quantizes the fp32 MLP: u8 activations (per tensor, calibrated), s8
# weights (per output channel), fp32 bias, QuantizeLinear/DequantizeLinear around every MatMul.
# The ``FoldQDQ`` pass turns each QDQ GEMM into an exact integer GEMM (u8 x s8 -> s32 with
# VNNI; s16 operands on AVX2 CPUs without VNNI) and its bias, ReLU and requantization into
# integer arithmetic in the GEMM's epilogue; layers pass 8-bit tensors to each other (widened
# to s16 inside the epilogue on AVX2).
import re

import numpy as np

import tvm_hybrid
from tvm_hybrid.bench import workloads
from tvm_hybrid.host import make_target
from tvm_hybrid.microkernels import integer_gemm_dtype, microkernels_for

target = make_target("host")
dims = (479, 1024, 1024, 512, 256, 1)
fp32 = workloads.mlp(32, dims, final="Sigmoid", name="mlp2")
qdq = workloads.qdq_mlp(32, dims, final="Sigmoid", name="mlp2")

fp32_model = tvm_hybrid.compile(fp32.model, target)
int8_model = tvm_hybrid.compile(qdq.model, target)
print("int8 kernels:")
for name in int8_model.kernel_names():
    print("  ", name)

# %%
# Accuracy
# --------
# Against the integer reference semantics (exact integer GEMMs, the bias rounded to the
# accumulator's scale, fixed-point requantization) the int8 model is bit-exact up to the final
# float Sigmoid; against the fp32 model the difference is the quantization error.
x = fp32.inputs["x"]
reference = workloads.qdq_reference(qdq)
out_int8, out_fp32 = int8_model(x), fp32_model(x)
print(f"int8 vs its integer reference: max |diff| {np.abs(out_int8 - reference).max():.1e}")
print(f"int8 vs fp32: max |diff| {np.abs(out_int8 - out_fp32).max():.1e} "
      f"(outputs in [0, 1])")
if integer_gemm_dtype(target, -128, 127):
    np.testing.assert_allclose(out_int8, reference, rtol=1e-6, atol=1e-7)

# %%
# Speed
# -----
t_fp32 = fp32_model.benchmark(x)["median_ms"]
t_int8 = int8_model.benchmark(x)["median_ms"]
print(f"fp32 {t_fp32:.3f} ms, int8 {t_int8:.3f} ms: {t_fp32 / t_int8:.1f}x")

# %%
# The integer microkernel
# -----------------------
# With VNNI, ``vpdpbusd`` multiplies 4 u8 by 4 s8 per 32-bit lane and adds them to the s32
# accumulator exactly; weights are packed at compile time with K in groups of 4. Without VNNI
# (AVX2), ``vpmaddwd`` multiplies pairs of s16 (8-bit values widened: weights at compile time,
# activations in the producer's epilogue), also exactly; ONNX Runtime's ``vpmaddubsw`` would be
# a little faster but saturates.
dtype = integer_gemm_dtype(target, -128, 127)
if dtype is not None:
    instruction = "vpdpbusd" if dtype == "uint8" else "vpmaddwd"
    asm = int8_model.inspect_source("asm")
    print(f"{instruction} instructions:", len(re.findall(rf"\b{instruction}\b", asm)))

# %%
# bf16 mode
# ---------
# ``precision="bf16"`` keeps fp32 inputs and outputs, like OpenVINO's inference precision hint:
# weights are rounded to bf16 at compile time, activations at run time, and ``vdpbf16ps``
# accumulates in fp32. Expect a relative error around 1e-3 on a GEMM's output. Without
# AVX512-BF16 the bf16 weights are widened to fp32 inside the microkernel (emulated bf16
# compute: the same results, half the weight memory, fp32 speed).
bf16_kernels = microkernels_for(target, "bfloat16", include_blocks=False)
if bf16_kernels:
    print("bf16 microkernels:", bf16_kernels[0].isa)
    bert = workloads.bert_layer(1, 128)
    bert_fp32 = tvm_hybrid.compile(bert.model, target)
    bert_bf16 = tvm_hybrid.compile(bert.model, target, precision="bf16")
    a, b = bert_bf16(**bert.inputs), bert_fp32(**bert.inputs)
    print(f"BERT layer bf16 vs fp32: max error {np.abs(a - b).max() / np.abs(b).max():.1e} of "
          "the output scale")
    print(f"fp32 {bert_fp32.benchmark(**bert.inputs)['median_ms']:.2f} ms, bf16 "
          f"{bert_bf16.benchmark(**bert.inputs)['median_ms']:.2f} ms")
else:
    print("this CPU has neither AVX2 nor AVX-512: precision='bf16' raises TargetError here")

# %%
# How AMX is selected
# -------------------
# AMX microkernels (``tdpbusd`` for int8, ``tdpbf16ps`` for bf16) are chosen only when the
# target has ``amx-tile`` and ``amx-int8``/``amx-bf16`` and the GEMM is a whole number of AMX
# tiles (M and N multiples of 32, K of 64 for int8 or 32 for bf16); other shapes use VNNI or
# AVX512-BF16. The microkernel covers a whole block, so the tiles are configured once per block
# (``ldtilecfg``). Compiling for Sapphire Rapids works on any machine; running it needs AMX
# (this package asks Linux for the tile permission once per process, and refuses to run AMX
# code on a CPU without AMX instead of crashing).
spr = {"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 16}
amx_model = tvm_hybrid.compile(qdq.model, spr)
asm = amx_model.inspect_source("asm")
for instruction in ("ldtilecfg", "tileloadd", "tdpbusd", "tilestored", "tilerelease"):
    count = len(re.findall(r"\b" + instruction + r"\b", asm))
    print(f"{instruction}: {count}")
try:
    amx_model(x)
    print("ran on AMX")
except tvm_hybrid.TargetError as err:
    print("not run here:", str(err).split(";")[0])
# To run AMX code on a host with no package index, pack it with
# ``python python/tools/amx_bundle.py -o amx_bundle.tar.gz``: the compiled models, TVM's
# runtime without its compiler, and a check script that compares the outputs.

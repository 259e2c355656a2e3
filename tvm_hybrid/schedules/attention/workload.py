"""What one fused attention computes: shapes, operand layouts, mask and scale.

``out[b, h, i] = sum_j softmax_j(scale * Q[b, h, i] . K[b, h, j] + mask[b, h, i, j]) V[b, h, j]``

The operands are read where the graph left them: the head split of BERT/ViT exports
(``reshape`` to ``[b, s, h, d]`` then ``permute_dims`` to ``[b, h, s, d]``) is not copied, the
kernel reads the ``[b, s, h, d]`` tensor; ``K`` may also come transposed (``[b, h, d, s]``); the
output may be written in the ``[b, s, h, d]`` order the head merge wants. A layout is one of

========  ===================  =======================================================
layout    tensor shape         element ``(b, h, row, col)`` at
========  ===================  =======================================================
``bhsd``  ``[b, h, s, d]``     ``((b * h_ + h) * s_ + row) * d_ + col``
``bshd``  ``[b, s, h, d]``     ``((b * s_ + row) * h_ + h) * d_ + col``
``bhds``  ``[b, h, d, s]``     ``((b * h_ + h) * d_ + col) * s_ + row`` (``K`` only)
========  ===================  =======================================================

(``row`` is a token, ``col`` a head channel.) A rank-3 ``[n, s, d]`` operand is ``bhsd`` with
one head.
"""

from __future__ import annotations

import dataclasses
import json

LAYOUTS = ("bhsd", "bshd", "bhds")


@dataclasses.dataclass(frozen=True)
class Quantization:
    """The per-tensor quantization of an int8 (QDQ) attention: ``x = scale * (q - zero)``.

    ``Q``, ``K`` and ``V`` are ``u8`` tensors of their ``(scale, zero)``; the softmax output is
    quantized to ``p_scale``, ``p_zero`` (``p_zero`` as a ``u8`` zero point: an ``s8``
    quantization's zero point plus 128, the same integers shifted).
    """

    q_scale: float
    q_zero: int
    k_scale: float
    k_zero: int
    v_scale: float
    v_zero: int
    p_scale: float
    p_zero: int


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """One fused attention.

    Attributes
    ----------
    batch, heads, q_len, kv_len, head_dim
        The problem: ``batch x heads`` independent attentions of ``q_len`` queries over
        ``kv_len`` keys of ``head_dim`` channels (values have ``head_dim`` channels too).
    q_layout, k_layout, v_layout, out_layout
        How each tensor is laid out (module docstring).
    rank
        The rank of the graph's tensors (4, or 3 for ``[n, s, d]``).
    mask_shape
        The additive mask's shape (broadcasting to ``[batch, heads, q_len, kv_len]``), or None.
    scale
        The factor on ``Q . K`` (``1 / sqrt(d)`` in BERT), or None.
    cond_shape, fill, keep_if
        A boolean mask (``where(cond, scores, fill)``, GPT's causal mask): its 4-d shape, the
        value of masked scores, and the ``cond`` value that keeps a score; applied before the
        additive mask. ``cond_shape`` None: none.
    quant
        For an int8 (QDQ) attention, the quantization of its operands and probabilities
        (``Q``, ``K``, ``V`` are then ``u8``); None for fp32.
    bf16
        Whether both products compute in bf16 (``precision="bf16"``: fp32 operands rounded to
        bf16, fp32 accumulation and softmax).
    """

    batch: int
    heads: int
    q_len: int
    kv_len: int
    head_dim: int
    q_layout: str = "bhsd"
    k_layout: str = "bhsd"
    v_layout: str = "bhsd"
    out_layout: str = "bhsd"
    rank: int = 4
    mask_shape: tuple[int, ...] | None = None
    scale: float | None = None
    cond_shape: tuple[int, ...] | None = None
    fill: float = 0.0
    keep_if: bool = True
    quant: Quantization | None = None
    bf16: bool = False

    def __post_init__(self):
        for name in ("q_layout", "k_layout", "v_layout", "out_layout"):
            layout = getattr(self, name)
            if layout not in LAYOUTS or (layout == "bhds" and name != "k_layout"):
                raise ValueError(f"{name} {layout!r} is not a layout attention reads")

    @property
    def key(self) -> str:
        """A stable string naming the workload (the kernel's attribute, tuning records);
        ``bf16`` only when set, so fp32 keys stay those of earlier records."""
        fields = dataclasses.asdict(self)
        if not self.bf16:
            del fields["bf16"]
        return json.dumps(fields, sort_keys=True)

    @classmethod
    def from_key(cls, key: str) -> AttentionShape:
        data = json.loads(key)
        for name in ("mask_shape", "cond_shape"):
            if data.get(name) is not None:
                data[name] = tuple(data[name])
        if data.get("quant") is not None:
            data["quant"] = Quantization(**data["quant"])
        return cls(**data)

    @property
    def flops(self) -> float:
        """Multiply-adds of both products, times two."""
        return 4.0 * self.batch * self.heads * self.q_len * self.kv_len * self.head_dim

    def tensor_shape(self, layout: str, rows: int) -> tuple[int, ...]:
        """The shape of an operand of ``rows`` tokens in ``layout``."""
        b, h, d = self.batch, self.heads, self.head_dim
        if self.rank == 3:
            return (b, d, rows) if layout == "bhds" else (b, rows, d)
        return {"bhsd": (b, h, rows, d), "bshd": (b, rows, h, d), "bhds": (b, h, d, rows)}[layout]

    def describe(self) -> str:
        mask = "no mask" if self.mask_shape is None else f"mask {list(self.mask_shape)}"
        if self.cond_shape is not None:
            mask += f", boolean mask {list(self.cond_shape)}"
        if self.quant is not None:
            mask += ", int8 QDQ"
        if self.bf16:
            mask += ", bf16"
        return (f"attention b{self.batch} h{self.heads} q{self.q_len} kv{self.kv_len} "
                f"d{self.head_dim} (Q {self.q_layout}, K {self.k_layout}, V {self.v_layout}, "
                f"out {self.out_layout}, {mask})")


def element_offset(layout: str, shape: AttentionShape, rows: int, b, h, row, col):
    """The flat offset of element ``(b, h, row, col)`` of an operand of ``rows`` tokens."""
    heads, d = shape.heads, shape.head_dim
    if layout == "bhsd":
        return ((b * heads + h) * rows + row) * d + col
    if layout == "bshd":
        return ((b * rows + row) * heads + h) * d + col
    return ((b * heads + h) * d + col) * rows + row


def row_strides(layout: str, shape: AttentionShape, rows: int) -> tuple[int, int]:
    """``(token stride, channel stride)`` of an operand of ``rows`` tokens in ``layout``."""
    if layout == "bhsd":
        return shape.head_dim, 1
    if layout == "bshd":
        return shape.heads * shape.head_dim, 1
    return 1, rows

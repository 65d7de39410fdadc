"""The quantized weights' "panel32" layout, as every kernel reads it (``kernels.quant`` has the
whole description): 32 output rows side by side per input, codes of 8 or 4 bits (``bits`` 8
or 4: integers; ``FP8`` / ``FP4``: float codes), a scale per row and group. A leaf: the
torch fallback (``kernels.quant``) and the Triton kernel (``kernels.triton_quant``) share it.
"""

from __future__ import annotations

COLS = 32
FP8 = -8
"""``bits`` of FP8 e4m3 codes: 8-bit panels whose bytes are e4m3 values (``fp8(u) * s``)."""
FP4 = -4
"""``bits`` of FP4 e2m1 codes (MXFP4): 4-bit panels whose nibbles are e2m1 values
(``fp4(u) * s``: sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6 by bits 0-2), no zero points."""
FP4_VALUES = tuple(sign * v for sign in (1.0, -1.0) for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6))


def packed_shapes(n: int, k: int, bits: int, group_size: int) -> tuple[tuple, tuple]:
    """The shapes of the packed codes and of the per-group tensors."""
    panels = (n + COLS - 1) // COLS
    return (panels, k * abs(bits) // 8, COLS), (panels, k // group_size, COLS)

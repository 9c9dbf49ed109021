"""Tolerances that follow from the arithmetic, not from the machine a test was written on.

Two float32 forwards of one model by different code (the engine's, transformers') sum their products in different
orders, and the same code sums differently on another CPU (BLAS kernels block by the vector width: AVX2 or
AVX-512, Intel or AMD). A float32 sum's rounding error is relative to the size of the terms summed, not to the
result: a logit near zero carries the rounding of the row's large ones. So a logit's tolerance is a fraction of its
row's scale (the largest logit's magnitude), whatever its own size.
"""
import torch

FLOAT32_ROW = 2e-5
"""Relative to a row's scale: float32 forwards of a few layers in two summation orders differ by a few hundred
float32 epsilons (1.2e-7) of the scale; measured 7.5e-7 on the tiny families' logits, so ~25x that."""

FP8_ROW = 5e-4
"""Relative to a row's scale, where activations are quantized to e4m3 per token: float32 that left an activation
a few epsilons either side of an e4m3 rounding tie on one machine quantizes it one e4m3 step apart (2^-3 of its
value) on another, and that step runs through the layers after it. Observed on an AMD EPYC: 2.0e-4 absolute on
logits of scale ~7 (2.9e-5 of it), 35x what the same comparison gives on the development box; 5e-4 of the scale
is 17x that, and still 3x under the difference quantizing makes (tests assert it, so the comparison tells one
numeric from the other)."""


def row_tolerance(want: torch.Tensor, fraction: float) -> torch.Tensor:
    """Each row's absolute tolerance, broadcast over its elements."""
    return fraction * want.abs().amax(dim=-1, keepdim=True)


def assert_logits_close(got: torch.Tensor, want: torch.Tensor, fraction: float = FLOAT32_ROW) -> None:
    """Every element of `got` within `fraction` of its row's scale of `want`; the message names the worst one."""
    excess = (got - want).abs() - row_tolerance(want, fraction)
    worst = int(excess.argmax())
    assert excess.max() <= 0, (f"logits differ beyond {fraction:g} of their row's scale: element {worst} (row "
                               f"{worst // want.shape[-1]}) by {float((got - want).flatten()[worst].abs()):.3g}, "
                               f"allowed {float(row_tolerance(want, fraction).expand_as(want).flatten()[worst]):.3g}")

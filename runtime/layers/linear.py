"""Linear layers. Merged projections (q|k|v, gate|up) run as one matmul and load per shard.

With `quantize("fp8")` (`--quantization fp8`) a layer still loads the checkpoint's weight into its
parameter (so the checkpoint layout, weight updates and reloads are unchanged), and its
`process_weights_after_loading` derives, into buffers allocated once by `quantize`, the e4m3 weight and
one float32 scale per output channel (`kernels.ops.fp8.quantize_fp8_rows`); the forward uses only those.
The high-precision weight stays allocated: a weight update loads into it and reprocesses (a known cost:
1.5x the projections' weight memory in bf16)."""
import torch
from torch import nn

from kernels.ops import fp8 as fp8_ops
from kernels.ops import linear as linear_ops
from runtime.config import QUANTIZATIONS  # --quantization


def check_quantization(method: str, device: torch.device | str) -> None:
    """Raise ValueError saying why `device` cannot run projections quantized by `method`."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization {method!r} not supported: use {', '.join(QUANTIZATIONS)}")
    reason = fp8_ops.fp8_unsupported_reason(device)
    if reason:
        raise ValueError(reason)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.quantization: str | None = None

    def quantize(self, method: str) -> None:
        """Run the projection as `method` from the next load on: allocates its derived tensors (on the
        weight's device, once: reprocessing fills them in place, so CUDA graphs keep their addresses)."""
        check_quantization(method, self.weight.device)
        n, k = self.weight.shape
        device = self.weight.device
        self.register_buffer("weight_fp8", torch.zeros(n, k, dtype=fp8_ops.FP8_DTYPE, device=device),
                             persistent=False)
        self.register_buffer("weight_scale", torch.ones(n, dtype=torch.float32, device=device), persistent=False)
        self.quantization = method

    def process_weights_after_loading(self) -> None:
        if self.quantization == "fp8":
            values, scales = fp8_ops.quantize_fp8_rows(self.weight)
            self.weight_fp8.copy_(values)
            self.weight_scale.copy_(scales.view(-1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantization == "fp8":
            return fp8_ops.fp8_linear(x, self.weight_fp8, self.weight_scale, self.bias)
        return linear_ops.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dimension."""

    def __init__(self, in_features: int, shards: dict[str, int]):
        super().__init__(in_features, sum(shards.values()))
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shards.items():
            self.shard_offsets[name] = (offset, size)
            offset += size

    def load_shard(self, shard: str, tensor: torch.Tensor) -> None:
        offset, size = self.shard_offsets[shard]
        target = self.weight.data[offset : offset + size]
        if target.shape != tensor.shape:
            raise ValueError(f"shard {shard}: expected shape {tuple(target.shape)}, checkpoint has {tuple(tensor.shape)}")
        target.copy_(tensor)

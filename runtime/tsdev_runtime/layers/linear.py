"""Linear layers. Merged projections (q|k|v, gate|up) run as one matmul and load per shard.

With `store_fp8_blocks` (a checkpoint stored as block-quantized FP8) a layer holds the e4m3 weight and its block
scales as the checkpoint stores them, nothing derived. With `quantize("fp8")` (`--quantization fp8`) a layer still loads
the checkpoint's weight into its parameter (so the checkpoint layout, weight updates and reloads are unchanged), and its
`process_weights_after_loading` derives, into buffers allocated once by `quantize`, the e4m3 weight and
one float32 scale per output channel (`tsdev_kernels.ops.fp8.quantize_fp8_rows`); the forward uses only those.
The high-precision weight stays allocated: a weight update loads into it and reprocesses (a known cost:
1.5x the projections' weight memory in bf16).

Tensor parallelism (`tsdev_runtime.distributed`) splits the projections Megatron's way: the merged ones (q|k|v,
gate|up) by output rows, each rank keeping its rows of every shard (its heads, its part of the MLP), so no
collective is needed; o_proj and down_proj (`RowParallelLinear`) by input columns, matching the split of their
input, and their partial outputs are summed over the ranks. Each rank loads only its slice of the checkpoint's
full tensors (`weight_slice`, runtime/tsdev_runtime/weights/keys.py), and quantizes its own weight (fp8 scales per local
output channel)."""
import torch
from torch import nn

from tsdev_kernels.ops import fp8 as fp8_ops
from tsdev_kernels.ops import fp8_block
from tsdev_kernels.ops import linear as linear_ops
from tsdev_kernels.ops import use_fused_triton
from tsdev_runtime import distributed
from tsdev_runtime.config import QUANTIZATIONS  # --quantization
from tsdev_runtime.layers.activation import SiluAndMul
from tsdev_runtime.layers.norm import RMSNorm
from tsdev_runtime.weights.keys import DeclaredLoading, Key
from tsdev_runtime.weights.layout import RankSlice, block_part


def check_quantization(method: str, device: torch.device | str) -> None:
    """Raise ValueError saying why `device` cannot run projections quantized by `method`."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization {method!r} not supported: use {', '.join(QUANTIZATIONS)}")
    reason = fp8_ops.fp8_unsupported_reason(device)
    if reason:
        raise ValueError(reason)


class Linear(DeclaredLoading, nn.Module):
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

    def store_fp8_blocks(self, block: tuple[int, int]) -> None:
        """Hold the weight as a block-FP8 checkpoint stores it: e4m3 [N, K] and one float32 multiplier per block
        (`weight_scale_inv`, loaded as stored: nothing is derived), run by the w8a8-block arithmetic
        (kernels/tsdev_kernels/ops/fp8_block.py: Triton on CUDA, the torch reference elsewhere)."""
        n, k = self.weight.shape
        device = self.weight.device
        self.weight = nn.Parameter(torch.empty(n, k, dtype=fp8_block.E4M3, device=device), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(-(-n // block[0]), -(-k // block[1]), dtype=torch.float32,
                                                         device=device), requires_grad=False)
        self.block, self.quantization = block, "fp8_block"

    def process_weights_after_loading(self) -> None:
        if self.quantization == "fp8":
            values, scales = fp8_ops.quantize_fp8_rows(self.weight)
            self.weight_fp8.copy_(values)
            self.weight_scale.copy_(scales.view(-1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, self.bias)

    def project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quantization == "fp8_block":
            return fp8_block.fp8_block_linear(x, self.weight, self.weight_scale_inv, self.block, bias)
        if self.quantization == "fp8":
            return fp8_ops.fp8_linear(x, self.weight_fp8, self.weight_scale, bias)
        return linear_ops.linear(x, self.weight, bias)


class RowParallelLinear(Linear):
    """A projection whose input features are split over the tensor-parallel ranks (o_proj after this rank's
    heads, down_proj after its part of the MLP): each rank holds its columns of the weight, and the partial
    outputs are summed over the ranks. The bias (whole on every rank) joins rank 0's partial sum only, so the
    sum has it once and a single rank computes exactly what a plain Linear does."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        start, length = distributed.shard(in_features, "a row-parallel projection's input features")
        super().__init__(length, out_features, bias)
        self.columns = RankSlice((out_features, in_features), 1, start, length)

    def weight_slice(self, param: str, key: Key) -> RankSlice | None:
        """This rank's columns of the checkpoint's weight, or of its block scales (None: the whole tensor, as the
        bias)."""
        if param == "weight_scale_inv":
            return block_part(self.columns, self.block[1], "a row-parallel projection's input features")
        return self.columns if param == "weight" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return distributed.all_reduce(self.project(x, self.bias if distributed.rank() == 0 else None))


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dimension, each split by rows over the
    tensor-parallel ranks: this rank holds its rows of every shard, stacked in shard order (`shard_offsets`:
    where each shard's rows start in this rank's weight, and how many), so its output is its part of each.

    `shards`: each shard's rows in the checkpoint, or this rank's `RankSlice` of them where the split is not an
    even one (key/value heads replicated over more ranks than there are heads). With `bias` each shard has its
    bias rows too (Qwen2's q|k|v), loaded and split like the weight's."""

    def __init__(self, in_features: int, shards: dict[str, int | RankSlice], bias: bool = False,
                 checkpoint_name: str = "{}_proj"):
        slices = {name: size if isinstance(size, RankSlice) else
                  RankSlice((size, in_features), 0, *distributed.shard(size, f"the {name} projection's rows"))
                  for name, size in shards.items()}
        super().__init__(in_features, sum(s.length for s in slices.values()), bias)
        self.shard_slices = slices
        self.checkpoint_name = checkpoint_name  # each shard's module in the checkpoint: q -> q_proj
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, part in slices.items():
            self.shard_offsets[name] = (offset, part.length)
            offset += part.length

    def store_fp8_blocks(self, block: tuple[int, int]) -> None:
        """Linear's, each shard's block scales stacked as its rows are: every shard must start on a block."""
        uneven = {name: size for name, (_, size) in self.shard_offsets.items() if size % block[0]}
        if uneven and len(self.shard_offsets) > 1:
            ranks = distributed.size()
            shards = ', '.join(f'{n}: {s} rows' for n, s in uneven.items())
            shards += f" on each of {ranks} ranks" if ranks > 1 else ""
            raise ValueError(f"a stacked projection's shards ({shards}) do not fill whole {block[0]}-row blocks of "
                             "FP8 scales: "
                             + ("serve with a --tp that leaves each rank whole blocks" if ranks > 1 else
                                "this checkpoint cannot be served stacked"))
        super().store_fp8_blocks(block)

    def checkpoint_names(self, attr: str) -> dict[str, tuple[str, Key]]:
        """Each shard's own tensors, beside this module in the checkpoint: q_proj.weight -> (weight, (q,))."""
        params = ["weight"] + (["bias"] if self.bias is not None else [])
        params += ["weight_scale_inv"] if self.quantization == "fp8_block" else []
        return {f"{self.checkpoint_name.format(shard)}.{param}": (param, (shard,))
                for shard in self.shard_slices for param in params}

    def weight_slice(self, param: str, key: Key) -> RankSlice:
        """This rank's rows of the checkpoint tensor of shard `key` (of the bias: the same rows)."""
        part = self.shard_slices[key[0]]
        if param == "weight_scale_inv":  # the blocks of this rank's rows
            return block_part(part, self.block[0], f"the {key[0]} projection's rows")
        return part if param == "weight" else RankSlice(part.shape[:1], 0, part.start, part.length)

    def load_weight(self, param: str, key: Key, tensor: torch.Tensor) -> None:
        """Copy this rank's rows of shard `key` into their place in `param` (weight, bias or block scales)."""
        offset, size = self.shard_offsets[key[0]]
        if param == "weight_scale_inv":  # a block of rows per scale row
            offset, size = offset // self.block[0], -(-size // self.block[0])
        target = getattr(self, param).data[offset : offset + size]
        if target.shape != tensor.shape:
            raise ValueError(f"shard {key[0]}: expected shape {tuple(target.shape)}, "
                             f"checkpoint has {tuple(tensor.shape)}")
        target.copy_(tensor)


def norm_linear(norm: RMSNorm, proj: Linear, x: torch.Tensor, residual: torch.Tensor | None,
                act: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm`, then `proj` (then `act`, SwiGLU's silu(gate) * up after a gate|up projection), the norm adding the
    residual stream first: `(act(proj(norm(x + residual))), x + residual)`, without a residual
    `(act(proj(norm(x))), x)`. A decoder layer's norm before q|k|v or gate|up.

    Where `gemv_fuses` says so (a decode step at batch 1 on CUDA) one GEMV kernel runs all three: it normalises its
    input and, for gate|up, applies silu(gate) * up to its output, with the norm and activation kernels' arithmetic (an
    edit of their Triton code reaches both; the Python forwards of RMSNorm and SiluAndMul are not called there).
    Elsewhere the modules run one after another."""
    if gemv_fuses(norm, proj, x, residual, act):
        weight, scale = (proj.weight_fp8, proj.weight_scale) if proj.quantization == "fp8" else (proj.weight, None)
        return linear_ops.gemv_triton(x, weight, proj.bias, weight_scale=scale, residual=residual,
                                      norm_weight=norm.weight, eps=norm.eps, gated=act is not None)
    hidden, residual = (norm(x), x) if residual is None else norm(x, residual)
    y = proj(hidden)
    return (y if act is None else act(y)), residual


def gemv_fuses(norm: RMSNorm, proj: Linear, x: torch.Tensor, residual: torch.Tensor | None,
               act: nn.Module | None) -> bool:
    """Whether `norm_linear` runs as one GEMV kernel: one row (the GEMV's shape), a weight it reads (not block-FP8),
    the stock RMSNorm and SiluAndMul (another class's arithmetic is not the kernel's: a subclass, another activation),
    one dtype throughout, and Triton serving every family it fuses (`use_fused_triton`: on CUDA, TSDEV_KERNELS taking
    none of them to the reference, a Gluon or a CuTe DSL kernel, which then serve batch 1 unfused too)."""
    if x.numel() != x.shape[-1] or proj.quantization == "fp8_block":
        return False
    if type(norm) is not RMSNorm or (act is not None and type(act) is not SiluAndMul):
        return False
    if norm.weight.dtype != x.dtype or (residual is not None and residual.dtype != x.dtype):
        return False
    return use_fused_triton(x, "norm", proj.quantization or "linear", *(("activation",) if act is not None else ()))

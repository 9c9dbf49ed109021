"""The experts of one sparse layer, stacked: `w13 [E, 2·I, H]` (each expert's gate rows, then its up rows) and
`w2 [E, H, I]`, so one grouped kernel (`kernels/tsdev_kernels/ops/moe.py`) runs every expert a step chose.

Loaded per expert from the hub's names (`mlp.experts.E.gate_proj.weight`, `up_proj`, `down_proj`) through the
declared-keys protocol (`runtime/tsdev_runtime/weights/keys.py`): w13 expects the keys (e, "gate") and (e, "up") of
every expert, w2 the keys (e, "down"), so "is this layer complete" is exact however the tensors arrive. Under tensor
parallelism each rank holds its slice of every expert's intermediate features (rows of gate and up, columns of down);
the partial outputs are summed after the layer.

FP8 (`quantize("fp8")`, `--quantization fp8`): the experts still load their checkpoint weights into w13 and w2 (so
layouts, direct updates and the checksum are unchanged), and each load's post-processing derives the e4m3 weights
and their scales, one float32 per (expert, output row), into one kernel-configuration object (`Fp8Experts`) that the
kernels read. That object is made once, at `quantize`, and every later load refreshes its tensors in place: CUDA
graphs captured their addresses. (Rebuilding it at each load, as a fused-MoE implementation once did, leaves
captured graphs reading the old tensors after sleep(2) + reload_weights: `TSDEV_DEBUG_DERIVED=rebuild` does exactly
that, as the weights drill's negative control.)

Block-FP8 checkpoints (`store_fp8_blocks`: Qwen's *-FP8 MoE releases): w13 and w2 hold the e4m3 weights as stored and
`w13_scale_inv [E, 2·I / 128, ceil(H / 128)]`, `w2_scale_inv [E, ceil(H / 128), I / 128]` their blocks' multipliers
(gate's rows of blocks, then up's), loaded per expert as stored: nothing is derived."""
import os
from dataclasses import dataclass

import torch
from torch import nn

from tsdev_kernels.ops import fp8 as fp8_ops
from tsdev_kernels.ops import fp8_block
from tsdev_kernels.ops import moe as moe_ops
from tsdev_runtime import distributed
from tsdev_runtime.weights.keys import DeclaredLoading, Key
from tsdev_runtime.weights.layout import RankSlice, block_part
from tsdev_runtime.weights.processing import DEBUG_DERIVED_ENV

PROJECTIONS = {"gate": "w13", "up": "w13", "down": "w2"}


@dataclass(frozen=True)
class Fp8Experts:
    """What the fused-MoE kernels read for FP8 experts: e4m3 `w13 [E, 2·I, H]`, `w2 [E, H, I]` and float32 scales
    `w13_scale [E, 2·I]`, `w2_scale [E, H]` (weight ~ e4m3 * scale, one scale per expert and output row)."""
    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor

    @classmethod
    def like(cls, w13: torch.Tensor, w2: torch.Tensor) -> "Fp8Experts":
        """Zeros of the shapes that quantizing w13 and w2 gives, on their device."""
        def values(w: torch.Tensor) -> torch.Tensor:
            return torch.zeros(w.shape, dtype=fp8_ops.FP8_DTYPE, device=w.device)

        def scales(w: torch.Tensor) -> torch.Tensor:
            return torch.ones(w.shape[:2], dtype=torch.float32, device=w.device)

        return cls(values(w13), scales(w13), values(w2), scales(w2))

    def refresh(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Quantize w13 and w2 into these tensors, in place."""
        for weight, values, scales in ((w13, self.w13, self.w13_scale), (w2, self.w2, self.w2_scale)):
            for e in range(weight.shape[0]):  # one expert at a time: the float32 temporaries stay one expert's size
                q, s = fp8_ops.quantize_fp8_rows(weight[e])
                values[e].copy_(q)
                scales[e].copy_(s.view(-1))


class StackedExperts(DeclaredLoading, nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        start, self.local_intermediate = distributed.shard(intermediate_size, "the experts' intermediate features")
        i = self.local_intermediate
        self.rows = RankSlice((intermediate_size, hidden_size), 0, start, i)  # of gate_proj / up_proj
        self.columns = RankSlice((hidden_size, intermediate_size), 1, start, i)  # of down_proj
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * i, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, i), requires_grad=False)
        self.fp8: Fp8Experts | None = None
        self.fp8_filled = False  # a load has derived into self.fp8
        self.block: tuple[int, int] | None = None  # (block_n, block_k) of a block-FP8 checkpoint's experts

    def store_fp8_blocks(self, block: tuple[int, int]) -> None:
        """Hold the experts as a block-FP8 checkpoint stores them (module docstring); this rank's intermediate
        features must fill whole blocks (gate's and up's rows, down's columns)."""
        i, (bn, bk) = self.local_intermediate, block
        if i % bn or i % bk:
            raise ValueError(f"the experts' {i} intermediate features (on this rank) do not fill whole {bn} x {bk} "
                             "blocks of FP8 scales: this checkpoint cannot be served (with --tp, try a smaller one)")
        e, h, device = self.num_experts, self.hidden_size, self.w13.device

        def param(*shape, dtype=fp8_block.E4M3):
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)
        self.w13, self.w2 = param(e, 2 * i, h), param(e, h, i)
        self.w13_scale_inv = param(e, 2 * i // bn, -(-h // bk), dtype=torch.float32)
        self.w2_scale_inv = param(e, -(-h // bn), i // bk, dtype=torch.float32)
        self.block = block

    def quantize(self, method: str) -> None:
        """Run the experts as `method` ("fp8") from the next load on: makes the kernel configuration, once, its
        tensors registered as (non-persistent) buffers so that sleep, wake and the checksum see them."""
        self.fp8 = Fp8Experts.like(self.w13, self.w2)
        for name in ("w13", "w13_scale", "w2", "w2_scale"):
            self.register_buffer(f"fp8_{name}", getattr(self.fp8, name), persistent=False)

    def process_weights_after_loading(self) -> None:
        if self.fp8 is None:
            return
        if self.fp8_filled and os.environ.get(DEBUG_DERIVED_ENV) == "rebuild":  # the drill's negative control
            self.fp8 = Fp8Experts.like(self.w13, self.w2)
        self.fp8.refresh(self.w13, self.w2)
        self.fp8_filled = True

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each token's chosen experts (`ids` [T, k]) weighted by `weights` [T, k] and summed: this rank's part of
        every expert's output (the caller sums the ranks')."""
        if self.block:  # a block-FP8 checkpoint's
            return moe_ops.fused_moe(x, self.w13, self.w2, weights, ids, self.w13_scale_inv, self.w2_scale_inv,
                                     block=self.block)
        if self.fp8 is None:
            return moe_ops.fused_moe(x, self.w13, self.w2, weights, ids)
        fp8 = self.fp8
        return moe_ops.fused_moe(x, fp8.w13, fp8.w2, weights, ids, fp8.w13_scale, fp8.w2_scale)

    def checkpoint_names(self, attr: str) -> dict[str, tuple[str, Key]]:
        names = {f"{attr}.{e}.{proj}_proj.weight": (param, (e, proj))
                 for e in range(self.num_experts) for proj, param in PROJECTIONS.items()}
        if self.block:
            names |= {f"{attr}.{e}.{proj}_proj.weight_scale_inv": (f"{param}_scale_inv", (e, proj))
                      for e in range(self.num_experts) for proj, param in PROJECTIONS.items()}
        return names

    def weight_slice(self, param: str, key: Key) -> RankSlice:
        part = self.columns if key[1] == "down" else self.rows
        if param.endswith("_scale_inv"):
            return block_part(part, self.block[part.dim], f"expert {key[0]}'s {key[1]}_proj")
        return part

    def load_weight(self, param: str, key: Key, tensor: torch.Tensor) -> None:
        expert, proj = key
        i = self.local_intermediate
        if param.endswith("_scale_inv"):
            rows = i // self.block[0]
            target = {"gate": self.w13_scale_inv.data[expert, :rows], "up": self.w13_scale_inv.data[expert, rows:],
                      "down": self.w2_scale_inv.data[expert]}[proj]
        else:
            target = {"gate": self.w13.data[expert, :i], "up": self.w13.data[expert, i:],
                      "down": self.w2.data[expert]}[proj]
        if target.shape != tensor.shape:
            raise ValueError(f"expert {expert} {proj}_proj ({param}): expected shape {tuple(target.shape)}, "
                             f"checkpoint has {tuple(tensor.shape)}")
        target.copy_(tensor)

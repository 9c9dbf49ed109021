from collections.abc import Callable

import torch
from torch import nn

from tsdev_kernels.ops import attention as attn_ops
from tsdev_kernels.ops import mla as mla_ops
from tsdev_runtime.context import get_context

# (layer, q, k, v) -> attention output: what a prefill graph runs in place of attend (vLLM's "splitting op")
GraphCut = Callable[["Attention", torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Attention(nn.Module):
    """Writes this step's K/V into the paged cache, then attends over each sequence's pages.

    k_cache / v_cache are views into the engine's KV pool, bound by the model runner. Under tensor parallelism
    `num_heads` and `num_kv_heads` are this rank's (`tsdev_runtime.distributed.shard`), and so is its pool.

    The one place where a forward may leave a CUDA graph: prefill graphs are captured in pieces cut at
    every attention call, since one bucket serves any mix of prompts, decodes and cached prefixes. While
    `graph_cut` is set (by `tsdev_runtime.engine.prefill_graphs.cut_at_attention`, only for one forward) `forward`
    hands q, k, v to it instead of attending: it ends the graph piece before, and `attend` runs outside
    the graph on the real rows. Per-instance state, so a reload of this module (which patches the class)
    keeps it.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.k_cache = self.v_cache = torch.tensor([])
        # an e4m3 pool's scales, one per tensor (--kv-cache-dtype fp8; docs/runtime.md): stored = value / scale
        self.kv_scales = (1.0, 1.0)
        self.graph_cut: GraphCut | None = None

    def cache_layout(self) -> tuple[int, int, int]:
        """What the KV pool holds per token for this layer: (caches, heads, values per head): a key and a value
        cache of this rank's KV heads."""
        return 2, self.num_kv_heads, self.head_dim

    def bind(self, caches: torch.Tensor) -> None:
        """Read and write the pool's views `caches` [caches, pages, page_size, heads, values] from now on."""
        self.k_cache, self.v_cache = caches[0], caches[1]

    def out_shape(self) -> tuple[int, int]:
        """(heads, values per head) of `attend`'s output per token."""
        return self.num_heads, self.head_dim

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.graph_cut is not None:  # a prefill graph is cut here: attention runs outside it
            return self.graph_cut(self, q, k, v)
        return self.attend(q, k, v)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
        ctx = get_context()
        return attn_ops.paged_attention(
            q, self.k_cache, self.v_cache, ctx.cu_seqlens_q, ctx.seq_lens, ctx.page_table, self.scale,
            max_q_len=ctx.max_q_len, out=out, store=(k, v, ctx.slot_mapping), order=ctx.order,
            kv_scales=self.kv_scales,
        )


class LatentAttention(Attention):
    """Multi-head latent attention (DeepSeek) in the absorbed form over a latent cache: per token one row of
    `latent_dim` + `rope_dim` values shared by every head (kernels/tsdev_kernels/ops/mla.py). q: [T, heads, latent +
    rope] (q_nope already multiplied into the latent space), k: this step's rows [T, 1, latent + rope], v: unused (the
    values are the rows' latent part); the output [T, heads, latent] goes through W_UV in the model."""

    def __init__(self, num_heads: int, latent_dim: int, rope_dim: int, scale: float):
        super().__init__(num_heads, 1, latent_dim + rope_dim)
        self.latent_dim, self.scale = latent_dim, scale

    def cache_layout(self) -> tuple[int, int, int]:
        return 1, 1, self.head_dim

    def bind(self, caches: torch.Tensor) -> None:
        self.k_cache = self.v_cache = caches[0]

    def out_shape(self) -> tuple[int, int]:
        return self.num_heads, self.latent_dim

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
        ctx = get_context()
        return mla_ops.mla_attention(q, self.k_cache, ctx.cu_seqlens_q, ctx.seq_lens, ctx.page_table, self.scale,
                                     self.latent_dim, max_q_len=ctx.max_q_len, out=out, store=(k, ctx.slot_mapping),
                                     order=ctx.order, kv_scale=self.kv_scales[0])

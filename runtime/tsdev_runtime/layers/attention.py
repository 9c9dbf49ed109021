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
            kv_scales=self.kv_scales, decodes=ctx.decodes,
        )


class LatentAttention(Attention):
    """Multi-head latent attention (DeepSeek) over a latent cache: per token one row of `latent_dim` + `rope_dim`
    values shared by every head (docs/mla.md). q: [T, heads, nope + rope] (each head's q_nope and rotated q_pe), k:
    this step's rows [T, 1, latent + rope], v: unused (the values come from the rows' latent part); the output [T,
    heads, v_dim] goes to o_proj.

    Two forms of the same attention. Absorbed (decode, short prefills): q_nope times W_UK into the latent space,
    multi-query attention over the cached rows (kernels/tsdev_kernels/ops/mla.py), the output times W_UV. Expanded
    (a step whose every sequence brings at least `EXPANDED_MIN_ROWS` new rows: long prompts): every cached row of the
    step's sequences expanded by W_UK and W_UV into per-head keys and values, then ordinary attention: 320
    multiply-adds per head and key against the absorbed form's 1088, plus 131 k per head and cached row to expand;
    it pays from about 170 rows per sequence. W_UK [heads, nope, latent] and W_UV [heads, latent, v] are the model's
    (derived from kv_b_proj at each load, in place): this module refers to them, it does not own them."""

    EXPANDED_MIN_ROWS = 256  # from the multiply-add count above; not yet measured against the absorbed kernel

    def __init__(self, num_heads: int, latent_dim: int, rope_dim: int, nope_dim: int, v_dim: int, scale: float,
                 w_uk: torch.Tensor, w_uv: torch.Tensor):
        super().__init__(num_heads, 1, latent_dim + rope_dim)
        self.latent_dim, self.rope_dim, self.nope_dim, self.v_dim, self.scale = (latent_dim, rope_dim, nope_dim,
                                                                                 v_dim, scale)
        for name, tensor in (("w_uk", w_uk), ("w_uv", w_uv)):  # shared, not owned (not registered)
            object.__setattr__(self, name, tensor)

    def cache_layout(self) -> tuple[int, int, int]:
        return 1, 1, self.head_dim

    def bind(self, caches: torch.Tensor) -> None:
        self.k_cache = self.v_cache = caches[0]

    def out_shape(self) -> tuple[int, int]:
        return self.num_heads, self.v_dim

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
        ctx = get_context()
        out = q.new_empty(q.shape[0], self.num_heads, self.v_dim) if out is None else out
        if ctx.q_lens is not None and ctx.max_q_len > 1 and min(ctx.q_lens) >= self.EXPANDED_MIN_ROWS:
            return self.attend_expanded(q, k, ctx, out)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [T, heads, latent]
        o_latent = mla_ops.mla_attention(torch.cat([q_latent, q_pe], dim=-1), self.k_cache, ctx.cu_seqlens_q,
                                         ctx.seq_lens, ctx.page_table, self.scale, self.latent_dim,
                                         max_q_len=ctx.max_q_len, store=(k, ctx.slot_mapping), order=ctx.order,
                                         kv_scale=self.kv_scales[0], decodes=ctx.decodes)
        out.copy_(torch.bmm(o_latent.transpose(0, 1), self.w_uv).transpose(0, 1))
        return out

    def attend_expanded(self, q: torch.Tensor, k: torch.Tensor, ctx, out: torch.Tensor) -> torch.Tensor:
        """Store this step's rows, expand every cached row of the step's sequences into per-head keys and values,
        and attend over them as paged attention with one-token pages (attention.py's kernels)."""
        mla_ops.store_latent(k, self.k_cache, ctx.slot_mapping, self.kv_scales[0])
        page, lengths = self.k_cache.shape[1], ctx.seq_lens_host
        total, longest, heads = sum(lengths), max(lengths), self.num_heads
        # each cached token of each sequence: its sequence, its position, its slot in the pool (on the device)
        lens = ctx.seq_lens.long()
        seq = torch.repeat_interleave(torch.arange(len(lengths), device=q.device), lens, output_size=total)
        first = torch.cumsum(lens, 0) - lens
        pos = torch.arange(total, device=q.device) - first[seq]
        slots = ctx.page_table[seq, pos // page].long() * page + pos % page
        rows = attn_ops.dequantize_kv(self.k_cache.view(-1, self.head_dim)[slots], self.kv_scales[0]).to(q.dtype)
        latent, k_pe = rows.split([self.latent_dim, self.rope_dim], dim=-1)
        k_nope = torch.einsum("nl,hdl->nhd", latent, self.w_uk)
        values = torch.einsum("nl,hlv->nhv", latent, self.w_uv)
        width = max(self.nope_dim + self.rope_dim, self.v_dim)  # one head width for q, k and v (zero-padded)
        keys = torch.cat([k_nope, k_pe[:, None].expand(total, heads, self.rope_dim)], dim=-1)
        pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[-1]))  # noqa: E731
        table = (first[:, None] + torch.arange(longest, device=q.device)).clamp(max=total - 1).to(torch.int32)
        o = attn_ops.paged_attention(pad(q).contiguous(), pad(keys).view(total, 1, heads, width),
                                     pad(values).view(total, 1, heads, width), ctx.cu_seqlens_q, ctx.seq_lens,
                                     table, self.scale, max_q_len=ctx.max_q_len)
        out.copy_(o[..., : self.v_dim])
        return out

import torch
from torch import nn

from kernels.ops import attention as attn_ops
from runtime.context import get_context


class Attention(nn.Module):
    """Writes this step's K/V into the paged cache, then attends over each sequence's pages.

    k_cache / v_cache are views into the engine's KV pool, bound by the model runner.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.k_cache = self.v_cache = torch.tensor([])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        if ctx.attention_break is not None:
            return ctx.attention_break(self, q, k, v)
        return self.attend(q, k, v)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        ctx = get_context()
        attn_ops.store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        return attn_ops.paged_attention(
            q, self.k_cache, self.v_cache, ctx.cu_seqlens_q, ctx.seq_lens, ctx.page_table, self.scale,
            max_q_len=ctx.max_q_len, out=out,
        )

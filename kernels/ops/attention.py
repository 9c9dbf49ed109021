"""Paged attention: the KV cache lives in fixed-size pages; each sequence has a page table.

Cache layout, per layer: k_cache and v_cache of shape [num_pages, page_size, num_kv_heads, head_dim].
A token's slot is page * page_size + offset; slot -1 marks a padding row that writes nothing.

One call serves a whole mixed batch: sequence i owns query rows cu_seqlens_q[i]:cu_seqlens_q[i+1]
(a prefill chunk or a single decode token), which are the last q_len of its seq_lens[i] tokens;
it attends causally to all of them, read through its page table (cached prefix included).
"""
import torch


def store_kvcache_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: [T, Hk, D]; writes row t into slot slot_mapping[t] unless it is -1."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[valid]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[valid]


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D]. One sequence at a time, in float32."""
    out = torch.zeros_like(q)
    page_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    for i, (start, end, seq_len) in enumerate(zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist(), seq_lens.tolist())):
        q_len = end - start
        if q_len == 0:
            continue
        pages = page_table[i, : (seq_len + page_size - 1) // page_size].long()
        k = k_cache[pages].flatten(0, 1)[:seq_len].float().repeat_interleave(group, dim=1)
        v = v_cache[pages].flatten(0, 1)[:seq_len].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        causal = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~causal, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


def store_kvcache(k, v, k_cache, v_cache, slot_mapping) -> None:
    store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, page_table, scale) -> torch.Tensor:
    return paged_attention_ref(q, k_cache, v_cache, cu_seqlens_q, seq_lens, page_table, scale)

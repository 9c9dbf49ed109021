"""Per-forward batch metadata, set by the model runner (and by the graphs while they capture), read by the
attention and logits layers.

One object instead of threading these tensors through every forward (as nano-vllm does). Pure data: how
a forward runs (e.g. attention cut out of a prefill graph) is the layers' own state, not the context's.
"""
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class Context:
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: sequence i owns query rows cu[i]:cu[i+1]
    seq_lens: torch.Tensor  # [B] int32: KV length of each sequence after this step
    page_table: torch.Tensor  # [B, max_pages] int32
    slot_mapping: torch.Tensor  # [T] int64, -1 for padding rows
    logits_indices: torch.Tensor  # [S] int64: rows whose next token is sampled
    max_q_len: int  # longest query of the batch: 1 takes the decode kernel
    # [B] int64: the order the attention kernels start the sequences in (attention.longest_first; in a mixed step
    # attention.split_order's: the leading decodes' order, then the rest's)
    order: torch.Tensor | None = None
    # the host's copies of each sequence's new rows and KV length (None inside graphs, whose steps are decodes)
    q_lens: list[int] | None = None
    seq_lens_host: list[int] | None = None
    # a mixed step's leading sequences of one row each, which attention runs on the decode kernel (0: none apart)
    decodes: int = 0


_context: Context | None = None


@contextmanager
def step_context(context: Context) -> Iterator[Context]:
    """The context of the forward run inside (the one place a context is set): cleared after, a failure too."""
    global _context
    _context = context
    try:
        yield context
    finally:
        _context = None


def get_context() -> Context:
    if _context is None:
        raise RuntimeError("no step context is set: layers that read it run only inside ModelRunner")
    return _context

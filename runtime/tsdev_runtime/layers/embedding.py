"""The token embedding and the logits, split over the tensor-parallel ranks by vocabulary rows.

Each rank holds vocab/N consecutive rows, the vocabulary padded up to a multiple of the ranks (the padded rows
are zeros, and never read: no id reaches them, and their logits are cut off). The embedding looks up the ids in
this rank's range and sums the ranks' rows (each id is found on exactly one rank); the logits are every rank's
columns gathered in rank order. With tied embeddings both modules share one parameter: the same rows.
"""
import torch
import torch.nn.functional as F
from torch import nn

from tsdev_kernels.ops import linear as linear_ops
from tsdev_runtime import distributed
from tsdev_runtime.context import get_context
from tsdev_runtime.weights.keys import DeclaredLoading, Key
from tsdev_runtime.weights.layout import RankSlice


class VocabEmbedding(DeclaredLoading, nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        ranks = distributed.size()
        self.vocab_start, rows = distributed.shard(-(-vocab_size // ranks) * ranks, "the padded vocabulary")
        self.weight = nn.Parameter(torch.zeros(rows, hidden_size), requires_grad=False)
        # the last rank's rows past the real vocabulary (padding) are not in the checkpoint
        self.rows = RankSlice((vocab_size, hidden_size), 0, self.vocab_start, min(rows, vocab_size - self.vocab_start))

    def weight_slice(self, param: str, key: Key) -> RankSlice:
        return self.rows

    def load_weight(self, param: str, key: Key, tensor: torch.Tensor) -> None:
        self.weight.data.narrow(0, 0, self.rows.length).copy_(tensor)  # the padded rows stay zeros

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not distributed.initialized():
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        elsewhere = (local < 0) | (local >= self.weight.shape[0])  # ids another rank holds: zeros here
        embeds = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        return distributed.all_reduce(embeds.masked_fill_(elsewhere.unsqueeze(-1), 0))


class LMHead(VocabEmbedding):
    """Computes logits only for the rows the step samples from (the last token of each sequence)."""

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits [rows, vocab]; written into `out` when given (the decode graphs' static buffer: the
        conversion to float32 then writes there directly, one pass over the logits instead of two)."""
        hidden = hidden[get_context().logits_indices]
        if (hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16)
                and hidden.shape[0] > linear_ops.SKINNY_ROWS and not distributed.initialized()):
            # cuBLAS writes float32 from the half-precision operands itself: no half logits written, read back
            # and converted (at 256 rows on the H200 that pass took 111 us)
            return torch.mm(hidden, self.weight.t(), out_dtype=torch.float32, **({} if out is None else {"out": out}))
        logits = distributed.all_gather_last(linear_ops.linear(hidden, self.weight))[..., : self.vocab_size]
        return logits.float().contiguous() if out is None else out.copy_(logits)

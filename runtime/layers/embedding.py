import torch
import torch.nn.functional as F
from torch import nn

from kernels.ops import linear as linear_ops
from runtime.context import get_context


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(VocabEmbedding):
    """Computes logits only for the rows the step samples from (the last token of each sequence)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden[get_context().logits_indices]
        return linear_ops.linear(hidden, self.weight).float()

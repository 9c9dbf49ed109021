"""Temperature / top-k / top-p sampling for a batch whose rows have different parameters.

Sampling draws with the exponential race (argmax of probs / Exp(1) noise), which equals a
multinomial draw and lets seeded rows take their noise from their own generator, so a seeded
request gives the same tokens whatever else is in the batch.
"""
import torch
from torch import nn


class Sampler(nn.Module):
    def forward(
        self,
        logits: torch.Tensor,  # [S, V] float32
        temperatures: torch.Tensor,  # [S] float32, 0 = greedy
        top_ks: torch.Tensor,  # [S] int64, 0 = off
        top_ps: torch.Tensor,  # [S] float32, 1 = off
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:
        greedy = logits.argmax(dim=-1)
        if not bool((temperatures > 0).any()):
            return greedy
        logits = logits / temperatures.clamp(min=1e-5).unsqueeze(1)
        logits = apply_top_k_top_p(logits, top_ks, top_ps)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for row, generator in enumerate(generators):
            if generator is not None:
                noise[row].exponential_(generator=generator)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(temperatures > 0, sampled, greedy)


def apply_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k and top-p nucleus to -inf (the best token always stays)."""
    if not bool((top_ks > 0).any()) and not bool((top_ps < 1).any()):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
    k = torch.where(top_ks > 0, top_ks, logits.shape[-1]).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = mass_before >= top_ps.unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)

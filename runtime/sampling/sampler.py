"""Temperature / top-k / top-p sampling for a batch whose rows have different parameters.

Sampling draws with the exponential race (argmax of probs / Exp(1) noise), which equals a
multinomial draw and lets seeded rows take their noise from their own generator, so a seeded
request gives the same tokens whatever else is in the batch. Which paths run is decided from the
requests' parameters on the host, so the step never waits on the GPU to find out.
"""
import torch
from torch import nn


class Sampler(nn.Module):
    def forward(
        self,
        logits: torch.Tensor,  # [S, V] float32
        temperatures: list[float],  # 0 = greedy
        top_ks: list[int],  # 0 = off
        top_ps: list[float],  # 1 = off
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:
        greedy = logits.argmax(dim=-1)
        if all(t == 0 for t in temperatures):
            return greedy
        device = logits.device
        temps = torch.tensor(temperatures, dtype=torch.float32).to(device, non_blocking=True)
        logits = logits / temps.clamp(min=1e-5).unsqueeze(1)
        if any(k > 0 for k in top_ks) or any(p < 1 for p in top_ps):
            logits = apply_top_k_top_p(logits, torch.tensor(top_ks).to(device, non_blocking=True),
                                       torch.tensor(top_ps, dtype=torch.float32).to(device, non_blocking=True))
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for row, generator in enumerate(generators):
            if generator is not None:
                noise[row].exponential_(generator=generator)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(temps > 0, sampled, greedy)


def apply_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k, then outside its top-p nucleus, to -inf (the best token stays)."""
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

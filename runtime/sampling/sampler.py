"""Temperature / top-k / top-p sampling for a batch whose rows have different parameters.

The draw is the exponential race (argmax of probs / Exp(1) noise) with counter-based noise keyed by a
per-row seed (kernels.ops.sampling), so a seeded request gives the same tokens whatever else is in the
batch. Which path runs is decided from the requests' parameters on the host: the step never waits on
the GPU to find out.
"""
import torch
from torch import nn

from kernels.ops import sampling as sampling_ops

MAX_CANDIDATES = 1024  # top-k up to this uses the top-k kernel; larger needs the full sort


class Sampler(nn.Module):
    def forward(
        self,
        logits: torch.Tensor,  # [S, V] float32
        temperatures: list[float],  # 0 = greedy
        top_ks: list[int],  # 0 = off
        top_ps: list[float],  # 1 = off
        seeds: list[int],  # this step's noise seed per row
    ) -> torch.Tensor:
        sampled = [i for i, t in enumerate(temperatures) if t > 0]
        if not sampled:
            return logits.argmax(dim=-1)
        device = logits.device

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        return sampling_ops.sample(logits, tensor(temperatures, torch.float32), tensor(top_ks, torch.int64),
                                   tensor(top_ps, torch.float32), tensor(seeds, torch.int64),
                                   max_top_k=max_top_k([top_ks[i] for i in sampled], [top_ps[i] for i in sampled]))

    def warm(self, logits: torch.Tensor) -> None:
        """Run every sampling path a request can pick on these logits, so none compiles while serving
        (the top-k kernel has one binary per power-of-two number of candidates)."""
        for block in sampling_ops.candidate_blocks(MAX_CANDIDATES):
            self(logits, [0.8], [block], [0.9], [0])
        self(logits, [0.8], [0], [1.0], [0])  # no filters
        self(logits, [0.8], [0], [0.9], [0])  # top-p alone: the full sort


def max_top_k(top_ks: list[int], top_ps: list[float]) -> int | None:
    """The promise the sampling kernel needs about the sampled rows: 0 = no filters, K = every top_k in
    1..K (K small enough for the candidate kernel), None = anything (full sort)."""
    if all(k == 0 for k in top_ks) and all(p >= 1 for p in top_ps):
        return 0
    if all(0 < k <= MAX_CANDIDATES for k in top_ks):
        return max(top_ks)
    return None

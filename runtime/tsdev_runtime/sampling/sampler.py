"""Sampling for a batch whose rows have different parameters: temperature / top-k / top-p, and the extras
OpenAI and vLLM requests carry (logprobs, penalties, logit_bias, min_tokens).

The draw is the exponential race (argmax of probs / Exp(1) noise) with counter-based noise keyed by a
per-row seed (tsdev_kernels.ops.sampling), so a seeded request gives the same tokens whatever else is in the
batch. Which path runs is decided from the requests' parameters on the host: the step never waits on
the GPU to find out, and a step whose rows ask for no extras runs exactly the plain path.

The extras work on the device, batched. Logprobs are read from the raw logits (before anything changes
them). Penalties and biases read a request's own tables in `SamplerState` (one slot per request that uses
them: its token counts, its penalty values, its bias), which the sampler keeps up to date on the device after
every draw; a step sends only each row's slot. No per-token host work.
"""
from dataclasses import dataclass

import torch
from torch import nn

from tsdev_kernels.ops import sampling as sampling_ops
from tsdev_runtime.sampling.limits import MAX_LOGIT_BIAS

MAX_CANDIDATES = 1024  # top-k up to this uses the top-k kernel; larger needs the full sort


@dataclass
class Extras:
    """What a step's rows ask beyond the plain draw, as host lists (rows index the sampled rows)."""
    logprob_rows: list[int]  # rows whose token's logprob is returned
    top_n: int  # top logprobs returned for each of those rows (the largest any of them asked for)
    slots: list[int] | None  # per row: its SamplerState slot (-1: none), or None when no row has one
    suppress: list[tuple[int, int]]  # (row, token id): tokens a row may not draw yet (min_tokens)


@dataclass
class Sampled:
    tokens: torch.Tensor  # [S] int64, on the device
    # (logprob of the drawn token [L], top-N logprobs [L, N], their ids [L, N]) for Extras.logprob_rows
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # the same for the prompt positions a step computed for prompt logprobs (the model runner fills it)
    prompt_logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def tensors(self) -> list[torch.Tensor]:
        """What the engine copies back to the host: the tokens, then (when there are logprobs) every logprob
        value and id in one float64 tensor (ids below 2**53 are exact), so that a step makes one more copy."""
        parts = [t.flatten().double() for group in (self.logprobs, self.prompt_logprobs) if group for t in group]
        return [self.tokens, torch.cat(parts)] if parts else [self.tokens]

    def unpack(self, host: list[torch.Tensor]) -> tuple[list[int], list | None, list | None]:
        """`tensors()` on the host, as lists: the tokens, and the drawn and prompt (logprob, top values, top ids)."""
        flat, offset, groups = host[-1], 0, []
        for group in (self.logprobs, self.prompt_logprobs):
            if group is None:
                groups.append(None)
                continue
            rows, n = group[1].shape
            chosen = flat[offset : offset + rows].tolist()
            values = flat[offset + rows : offset + rows + rows * n].view(rows, n).tolist()
            ids = flat[offset + rows + rows * n : offset + rows + 2 * rows * n].view(rows, n).long().tolist()
            groups.append([chosen, values, ids])
            offset += rows + 2 * rows * n
        return host[0].tolist(), groups[0], groups[1]


class SamplerState:
    """Per-request tables the penalties and logit_bias read, on the device, one slot per request that uses them
    (the engine hands slots out, at most max_running at once; the last slot is the warm-up's): the token counts
    (PROMPT_BIT on the prompt's tokens), the three penalty values and the bias entries (tsdev_kernels.ops.sampling)."""

    def __init__(self, slots: int, vocab_size: int, device: torch.device):
        self.slots = slots
        self.counts = torch.zeros(slots, vocab_size, dtype=torch.int32, device=device)
        self.params = torch.zeros(slots, 3, dtype=torch.float32, device=device)
        self.bias_ids = torch.zeros(slots, MAX_LOGIT_BIAS, dtype=torch.int32, device=device)
        self.bias_values = torch.zeros(slots, MAX_LOGIT_BIAS, dtype=torch.float32, device=device)
        self.bias_count = torch.zeros(slots, dtype=torch.int32, device=device)

    def start(self, slot: int, history: list[int], num_prompt_tokens: int, presence: float, frequency: float,
              repetition: float, logit_bias: dict[int, float]) -> None:
        """A request takes `slot`: its prompt's tokens marked, the output tokens of its `history` (prompt, then
        output: none on its first draw, those read so far when it starts again after a failed step) counted, its
        penalties and bias."""
        device = self.counts.device
        history = torch.tensor(history, dtype=torch.int64).to(device)
        self.counts[slot].zero_()
        self.counts[slot].index_fill_(0, history[:num_prompt_tokens], sampling_ops.PROMPT_BIT)
        output = history[num_prompt_tokens:]
        self.counts[slot].index_add_(0, output, torch.ones_like(output, dtype=torch.int32))
        self.params[slot] = torch.tensor([presence, frequency, repetition]).to(device, non_blocking=True)
        n = len(logit_bias)
        self.bias_count[slot] = n
        if n:
            self.bias_ids[slot, :n] = torch.tensor(list(logit_bias), dtype=torch.int32).to(device, non_blocking=True)
            self.bias_values[slot, :n] = torch.tensor(list(logit_bias.values())).to(device, non_blocking=True)

    def process(self, logits: torch.Tensor, slots: torch.Tensor) -> None:
        """The bias, then the penalties, in place, for the rows with a slot."""
        sampling_ops.apply_penalties(logits, slots, self.counts, self.params, self.bias_ids, self.bias_values,
                                     self.bias_count)

    def count(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """The drawn tokens join their requests' histories (stream-ordered: the next step's draw sees them)."""
        sampling_ops.count_tokens(self.counts, slots, tokens)


class Sampler(nn.Module):
    def forward(
        self,
        logits: torch.Tensor,  # [S, V] float32; changed in place when penalties or biases apply
        temperatures: list[float],  # 0 = greedy
        top_ks: list[int],  # 0 = off
        top_ps: list[float],  # 1 = off
        seeds: list[int],  # this step's noise seed per row
        extras: Extras | None = None,
        state: SamplerState | None = None,
    ) -> Sampled:
        device = logits.device

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        raw, slots = logits, None
        if extras is not None and (extras.slots is not None or extras.suppress):
            if extras.logprob_rows:
                logits = logits.clone()  # logprobs come from the raw logits
            if extras.suppress:  # min_tokens: before the penalties (-inf stays -inf through them)
                rows, ids = zip(*extras.suppress)
                logits.index_put_((tensor(rows, torch.int64), tensor(ids, torch.int64)),
                                  torch.tensor(float("-inf"), device=device))
            if extras.slots is not None:
                slots = tensor(extras.slots, torch.int64)
                state.process(logits, slots)
        sampled = [i for i, t in enumerate(temperatures) if t > 0]
        if not sampled:
            tokens = logits.argmax(dim=-1)
        else:
            tokens = sampling_ops.sample(logits, tensor(temperatures, torch.float32), tensor(top_ks, torch.int64),
                                         tensor(top_ps, torch.float32), tensor(seeds, torch.int64),
                                         max_top_k=max_top_k([top_ks[i] for i in sampled],
                                                             [top_ps[i] for i in sampled]))
        if slots is not None:
            state.count(slots, tokens)
        if extras is None or not extras.logprob_rows:
            return Sampled(tokens)
        if len(extras.logprob_rows) < len(temperatures):
            rows = tensor(extras.logprob_rows, torch.int64)
            raw, tokens_of_rows = raw[rows], tokens[rows]
        else:
            tokens_of_rows = tokens
        return Sampled(tokens, sampling_ops.token_logprobs(raw, tokens_of_rows, extras.top_n))

    def warm(self, logits: torch.Tensor, state: SamplerState | None = None) -> None:
        """Run every sampling path a request can pick on these logits, so none compiles while serving
        (the top-k kernel has one binary per power-of-two number of candidates)."""
        for block in sampling_ops.candidate_blocks(MAX_CANDIDATES):
            self(logits, [0.8], [block], [0.9], [0])
        self(logits, [0.8], [0], [1.0], [0])  # no filters
        self(logits, [0.8], [0], [0.9], [0])  # top-p alone: the full sort
        if state is not None:  # the penalties, bias, count and logprobs kernels, on the last slot
            slot = state.slots - 1  # (the engine hands out the others)
            state.start(slot, [1, 2, 3, 4], 3, 0.5, 0.5, 1.2, {5: 1.0})
            self(logits.clone(), [0.8], [0], [1.0], [0], Extras([0], 5, [slot], [(0, 1)]), state)


def max_top_k(top_ks: list[int], top_ps: list[float]) -> int | None:
    """The promise the sampling kernel needs about the sampled rows: 0 = no filters, K = every top_k in
    1..K (K small enough for the candidate kernel), None = anything (full sort)."""
    if all(k == 0 for k in top_ks) and all(p >= 1 for p in top_ps):
        return 0
    if all(0 < k <= MAX_CANDIDATES for k in top_ks):
        return max(top_ks)
    return None

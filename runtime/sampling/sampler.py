"""Sampling for a batch whose rows have different parameters: temperature / top-k / top-p, and the extras
OpenAI and vLLM requests carry (logprobs, penalties, logit_bias, min_tokens).

The draw is the exponential race (argmax of probs / Exp(1) noise) with counter-based noise keyed by a
per-row seed (kernels.ops.sampling), so a seeded request gives the same tokens whatever else is in the
batch. Which path runs is decided from the requests' parameters on the host: the step never waits on
the GPU to find out, and a step whose rows ask for no extras runs exactly the plain path.

The extras work on the device, batched. Logprobs are read from the raw logits (before anything changes
them). Penalties read each request's history from `SamplerState`, one row of token counts per request
slot, which the sampler itself keeps up to date on the device after every draw: no per-token host work.
"""
from dataclasses import dataclass

import torch
from torch import nn

from kernels.ops import sampling as sampling_ops

MAX_CANDIDATES = 1024  # top-k up to this uses the top-k kernel; larger needs the full sort
MAX_LOGPROBS = 20  # top logprobs per token, as OpenAI's and vLLM's default limit
MAX_LOGIT_BIAS = 300  # entries of one request's logit_bias (OpenAI's limit)


@dataclass
class Extras:
    """What a step's rows ask beyond the plain draw, as host lists (rows index the sampled rows)."""
    logprob_rows: list[int]  # rows whose token's logprob is returned
    top_n: int  # top logprobs returned for each of those rows (the largest any of them asked for)
    slots: list[int] | None  # per row: its SamplerState slot (-1: none), or None when no row has one
    presence: list[float] | None
    frequency: list[float] | None
    repetition: list[float] | None
    suppress: list[tuple[int, int]]  # (row, token id): tokens a row may not draw yet (min_tokens)


@dataclass
class Sampled:
    tokens: torch.Tensor  # [S] int64, on the device
    # (logprob of the drawn token [L], top-N logprobs [L, N], their ids [L, N]) for Extras.logprob_rows
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # the same for the prompt positions a step computed for prompt logprobs (the model runner fills it)
    prompt_logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def tensors(self) -> list[torch.Tensor]:
        """What the engine copies back to the host, in a fixed order (`unpack` reads the lists back)."""
        return [self.tokens, *(self.logprobs or ()), *(self.prompt_logprobs or ())]


class SamplerState:
    """Per-request state the penalties and logit_bias read, on the device, one slot per request that uses them
    (the engine hands slots out, at most max_running at once): `counts` [slots, V] int32, the times each token was
    generated, with PROMPT_BIT on the prompt's tokens; the logit_bias entries, padded with zeros."""

    def __init__(self, slots: int, vocab_size: int, device: torch.device):
        self.slots = slots
        self.counts = torch.zeros(slots, vocab_size, dtype=torch.int32, device=device)
        self.bias_ids = torch.zeros(slots, MAX_LOGIT_BIAS, dtype=torch.int64, device=device)
        self.bias_values = torch.zeros(slots, MAX_LOGIT_BIAS, dtype=torch.float32, device=device)

    def start(self, slot: int, prompt: list[int], logit_bias: dict[int, float]) -> None:
        """A request takes `slot`: its prompt's tokens marked, no token generated yet, its bias."""
        device = self.counts.device
        self.counts[slot].zero_()
        self.counts[slot].index_fill_(0, torch.tensor(prompt, dtype=torch.int64).to(device), sampling_ops.PROMPT_BIT)
        self.bias_ids[slot].zero_()
        self.bias_values[slot].zero_()
        if logit_bias:
            n = len(logit_bias)
            self.bias_ids[slot, :n] = torch.tensor(list(logit_bias), dtype=torch.int64).to(device)
            self.bias_values[slot, :n] = torch.tensor(list(logit_bias.values()), dtype=torch.float32).to(device)

    def add_bias(self, logits: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """logits[row, token] += bias for every entry of each row's slot (the zero padding adds nothing)."""
        ids = self.bias_ids[slots]
        logits.index_put_((rows.unsqueeze(1).expand_as(ids), ids), self.bias_values[slots], accumulate=True)

    def count(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """The drawn tokens join their requests' histories (stream-ordered: the next step's draw sees them)."""
        self.counts.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)


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

        raw = logits
        if extras is not None and (extras.slots is not None or extras.suppress):
            if extras.logprob_rows:
                logits = logits.clone()  # logprobs come from the raw logits
            self.process(logits, extras, state, tensor)
        sampled = [i for i, t in enumerate(temperatures) if t > 0]
        if not sampled:
            tokens = logits.argmax(dim=-1)
        else:
            tokens = sampling_ops.sample(logits, tensor(temperatures, torch.float32), tensor(top_ks, torch.int64),
                                         tensor(top_ps, torch.float32), tensor(seeds, torch.int64),
                                         max_top_k=max_top_k([top_ks[i] for i in sampled], [top_ps[i] for i in sampled]))
        if extras is None:
            return Sampled(tokens)
        if extras.slots is not None:
            rows = [i for i, s in enumerate(extras.slots) if s >= 0]
            state.count(tensor([extras.slots[i] for i in rows], torch.int64), tokens[tensor(rows, torch.int64)])
        if not extras.logprob_rows:
            return Sampled(tokens)
        rows = tensor(extras.logprob_rows, torch.int64)
        return Sampled(tokens, sampling_ops.token_logprobs(raw[rows], tokens[rows], extras.top_n))

    @staticmethod
    def process(logits: torch.Tensor, extras: Extras, state: SamplerState, tensor) -> None:
        """Bias, min_tokens, then the penalties, in place (vLLM's order)."""
        if extras.slots is not None:
            rows = [i for i, s in enumerate(extras.slots) if s >= 0]
            state.add_bias(logits, tensor(rows, torch.int64), tensor([extras.slots[i] for i in rows], torch.int64))
        if extras.suppress:
            rows, ids = zip(*extras.suppress)
            logits.index_put_((tensor(rows, torch.int64), tensor(ids, torch.int64)),
                              torch.tensor(float("-inf"), device=logits.device))
        if extras.slots is not None:
            sampling_ops.apply_penalties(logits, tensor(extras.slots, torch.int64), state.counts,
                                         tensor(extras.presence, torch.float32), tensor(extras.frequency, torch.float32),
                                         tensor(extras.repetition, torch.float32))

    def warm(self, logits: torch.Tensor, state: SamplerState | None = None) -> None:
        """Run every sampling path a request can pick on these logits, so none compiles while serving
        (the top-k kernel has one binary per power-of-two number of candidates)."""
        for block in sampling_ops.candidate_blocks(MAX_CANDIDATES):
            self(logits, [0.8], [block], [0.9], [0])
        self(logits, [0.8], [0], [1.0], [0])  # no filters
        self(logits, [0.8], [0], [0.9], [0])  # top-p alone: the full sort
        if state is not None:  # the penalties kernel, the biases, min_tokens and logprobs, on the last slot
            slot = state.slots - 1  # (the engine hands out the others)
            state.start(slot, [1, 2, 3], {5: 1.0})
            extras = Extras([0], 5, [slot], [0.5], [0.5], [1.2], [(0, 1)])
            self(logits.clone(), [0.8], [0], [1.0], [0], extras, state)


def max_top_k(top_ks: list[int], top_ps: list[float]) -> int | None:
    """The promise the sampling kernel needs about the sampled rows: 0 = no filters, K = every top_k in
    1..K (K small enough for the candidate kernel), None = anything (full sort)."""
    if all(k == 0 for k in top_ks) and all(p >= 1 for p in top_ps):
        return 0
    if all(0 < k <= MAX_CANDIDATES for k in top_ks):
        return max(top_ks)
    return None

"""Breakable CUDA graphs for prefill and mixed steps: one graph per padded token bucket, cut at attention.

A forward of T tokens runs as the bucket B >= T. The token-shaped compute (norms, projections, rotary,
MLP) between two attention calls is one captured piece; attention runs eagerly between pieces on the
real rows only, from the live batch's metadata, so one bucket serves any mix of prefills, decodes and
cached prefixes. The embedding lookup stays outside (the graph starts from a static embeddings buffer)
and so do the logits of the sampled rows. Padding rows carry zero embeddings at position 0; they never
reach attention, so they write no KV at all. The cut is explicit: `cut_at_attention` installs it on the
model's `Attention` layers for one forward (see `Attention.graph_cut`); outside it they attend as usual.

Every piece of every bucket shares one private memory pool (never the decode graphs'). The tensors at
a cut (q, k, v and the final hidden state) are kept as non-owning views, so their memory goes back to
the pool and later pieces and buckets reuse it: a replay always writes them before reading them. The
attention output goes to one static buffer that every bucket and layer shares. As with the decode graphs, a reload
captures the buckets used since the last capture and leaves the rest pending (`capture_next`), eager until then.

On CPU nothing is captured and `forward` runs the same padded, cut forward eagerly, so CPU tests
exercise everything but the capture itself.
"""
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from tsdev_runtime import distributed
from tsdev_runtime.context import Context, step_context
from tsdev_runtime.engine.cuda_graphs import GraphSet, collector_paused, end_pool_routing, graph_properties
from tsdev_runtime.layers.attention import Attention, GraphCut

LADDER_START, LADDER_MIN_STEP, LADDER_MAX_STEP = 16, 16, 512


def prefill_buckets(max_tokens: int, token_budget: int, sizes: list[int] | None = None) -> list[int]:
    """Token buckets up to min(max_tokens, token_budget); [] when that is 0 (prefill graphs off).

    The ladder starts at 16 and steps by the largest power of two <= size / 8, clamped to 16..512, so
    padding wastes at most ~1/8 of a forward. Explicit sizes are clamped to the top, which is always in.
    """
    top = min(max_tokens, token_budget)
    if top <= 0:
        return []
    if sizes is not None:
        return sorted({min(s, top) for s in sizes} | {top})
    ladder, size = [], LADDER_START
    while size < top:
        ladder.append(size)
        size += min(LADDER_MAX_STEP, max(LADDER_MIN_STEP, 1 << ((size // 8).bit_length() - 1)))
    return ladder + [top]


@contextmanager
def cut_at_attention(layers: list[Attention], cut: GraphCut) -> Iterator[None]:
    """For the forward run inside: every attention layer hands q, k, v to `cut` instead of attending."""
    for layer in layers:
        layer.graph_cut = cut
    try:
        yield
    finally:
        for layer in layers:
            layer.graph_cut = None


def _non_owning(t: torch.Tensor) -> torch.Tensor:
    """A view of t's CUDA memory that does not keep it allocated (CUDA array interface, via an int type
    of the same width: the interface has no bfloat16)."""
    width = t.element_size()
    view = type("_Memory", (), {"__cuda_array_interface__": {
        "shape": tuple(t.shape), "typestr": f"<i{width}", "data": (t.data_ptr(), False), "version": 3,
        "strides": tuple(s * width for s in t.stride()),
    }})()
    return torch.as_tensor(view, device=t.device).view(t.dtype)


class _Bucket:
    """The captured pieces of one bucket and the tensors at its cuts."""

    def __init__(self, pool):
        self.pool = pool
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.cuts: list[tuple] = []  # (attention layer, q, k, v) after each piece but the last
        self.hidden: torch.Tensor | None = None
        self.current: torch.cuda.CUDAGraph | None = None
        self.properties: tuple = ()

    def begin(self) -> None:
        self.current = torch.cuda.CUDAGraph(keep_graph=True)  # its nodes: a kernel-only reload patches them
        self.current.capture_begin(pool=self.pool)

    def end(self) -> None:
        self.current.capture_end()
        self.current.instantiate()
        self.pieces.append(self.current)
        self.current = None

    def abandon(self) -> None:
        """After a failure mid-capture: leave capture mode so the device is usable again."""
        if self.current is not None:
            try:
                self.current.capture_end()
            except Exception:
                end_pool_routing(self.pool, torch.cuda.current_device())
            self.current = None


class PrefillGraphs(GraphSet):
    def __init__(self, model: torch.nn.Module, buckets: list[int], hidden_size: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__(buckets)
        self.model, self.device = model, device
        self.attention = [m for m in model.modules() if isinstance(m, Attention)]  # where every bucket is cut
        n = self.max_size
        with device:
            self.embeds = torch.zeros(n, hidden_size, dtype=dtype)
            self.positions = torch.zeros(n, dtype=torch.int64)
            self.attn_out = torch.zeros(n, *self.attention[0].out_shape(), dtype=dtype)  # every layer's, in turn
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.disabled: str | None = None  # why prefill runs eagerly after a failed capture

    @property
    def buckets(self) -> list[int]:
        return self.sizes

    @property
    def max_tokens(self) -> int:
        return self.max_size

    def cuda_graphs(self) -> list[torch.cuda.CUDAGraph]:
        return [piece for bucket in self.graphs.values() for piece in bucket.pieces]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, H] of a batch of T <= max_tokens tokens, under the live step context (set by
        the caller; attention reads it). Replays the bucket's graph when there is one."""
        num_tokens = input_ids.shape[0]
        size = self.size_for(num_tokens)
        self.used.add(size)
        self.embeds[:num_tokens].copy_(self.model.embed(input_ids))
        self.positions[:num_tokens].copy_(positions)
        self.embeds[num_tokens:size].zero_()
        self.positions[num_tokens:size].zero_()
        self.attn_out[num_tokens:size].zero_()
        bucket = self.graphs.get(size)
        if bucket is None or bucket.properties != graph_properties():
            return self._forward_eager(size, num_tokens)
        rows = slice(0, num_tokens)
        for piece, (layer, q, k, v) in zip(bucket.pieces, bucket.cuts):
            piece.replay()
            layer.attend(q[rows], k[rows], v[rows], out=self.attn_out[rows])
        bucket.pieces[-1].replay()
        return bucket.hidden[rows]

    def _forward_eager(self, size: int, num_tokens: int) -> torch.Tensor:
        """The same cut forward without graphs: attention on the real rows, into the shared buffer."""

        def attention(layer, q, k, v):
            layer.attend(q[:num_tokens], k[:num_tokens], v[:num_tokens], out=self.attn_out[:num_tokens])
            return self.attn_out[:size]

        with cut_at_attention(self.attention, attention):
            return self.model.forward_embeds(self.embeds[:size], self.positions[:size])[:num_tokens]

    def release(self) -> None:
        """Drop every bucket's graphs and their pool (sleep); the next `capture` uses a new pool. Until then
        `forward` runs eagerly."""
        self._drop()
        self.pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None

    def capture(self, strict: bool, buckets: list[int] | None = None) -> dict[int, float]:
        """Capture `buckets` (default every bucket), largest first; seconds per bucket. A no-op per bucket on CPU.
        The others are pending (`capture_next`).

        Out of memory raises, saying what to lower. Another failure raises when `strict` (a reload, which
        then rolls back), else prefill runs eagerly from now on, with a warning. Every rank must succeed
        for any to use the new graphs; they replace the old ones only then.
        """
        graphs, timings, error, out_of_memory = {}, {}, None, False
        try:
            with collector_paused():
                for size in self._to_capture(buckets):
                    start = time.perf_counter()
                    graphs[size] = self._capture(size)
                    timings[size] = time.perf_counter() - start
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception as exc:
            error, out_of_memory = f"{type(exc).__name__}: {exc}", isinstance(exc, torch.cuda.OutOfMemoryError)
        agreed = distributed.agree(error is None)  # every rank gets here, whatever failed
        if out_of_memory:
            raise RuntimeError(
                f"out of memory capturing the prefill graphs (buckets up to {self.max_tokens} tokens): lower "
                f"--prefill-graph-max-tokens or --gpu-memory-utilization, or pass --disable-prefill-graph ({error})")
        if not agreed:
            error = error or "another rank failed to capture its prefill graphs"
            if strict:
                raise RuntimeError(f"capturing the prefill graphs failed: {error}")
            self._drop()
            self.disabled = error
            print(f"warning: capturing the prefill graphs failed ({error}); prefill runs eagerly",
                  file=sys.stderr, flush=True)
            return {}
        self._replace(graphs)
        self.disabled = None
        return timings

    def capture_next(self) -> dict[int, float]:
        """Capture the largest pending bucket: {bucket: seconds}, or {} when it failed (on any rank: it stays
        eager, with a warning)."""
        size = self.pending.pop(0)
        start, bucket, error = time.perf_counter(), None, None
        try:
            with collector_paused():
                bucket = self._capture(size)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        if not distributed.agree(error is None):
            print(f"warning: capturing the prefill graph of {size} tokens failed ({error or 'on another rank'}); "
                  "that bucket runs eagerly", file=sys.stderr, flush=True)
            return {}
        if bucket is not None:
            self.graphs[size] = bucket
        return {size: time.perf_counter() - start}

    def _capture(self, size: int) -> _Bucket | None:
        if self.device.type != "cuda":
            return None
        bucket = _Bucket(self.pool)

        def cut(layer, q, k, v):
            bucket.end()
            bucket.cuts.append((layer, _non_owning(q), _non_owning(k), _non_owning(v)))
            bucket.begin()
            return self.attn_out[:size]

        rows = torch.arange(size, device=self.device)
        context = Context(cu_seqlens_q=torch.tensor([0, size], dtype=torch.int32, device=self.device),
                          seq_lens=torch.tensor([size], dtype=torch.int32, device=self.device),
                          page_table=torch.zeros(1, 1, dtype=torch.int32, device=self.device), slot_mapping=rows,
                          logits_indices=rows, max_q_len=size)
        torch.cuda.synchronize(self.device)
        # as the engine's forwards run, but each attention call ends a piece and begins the next
        with step_context(context), torch.inference_mode(), torch.cuda.stream(self.stream), \
                cut_at_attention(self.attention, cut):
            bucket.properties = graph_properties()
            try:
                bucket.begin()
                hidden = self.model.forward_embeds(self.embeds[:size], self.positions[:size])
                bucket.end()
            finally:
                bucket.abandon()  # on the capture stream, where the capture must end
        bucket.hidden = _non_owning(hidden)
        return bucket

"""Decode steps replayed from CUDA graphs, one graph per batch size in one shared memory pool.

A decode batch of n sequences runs the graph of the smallest captured size >= n; the extra rows are
padding (slot -1: they write no KV; their logits are dropped). Inputs live in static buffers that each
step overwrites. On CPU nothing is captured and `run` executes the same padded static batch eagerly,
so CPU tests exercise everything but the capture itself.
"""
import time

import torch

from runtime.context import Context, set_context


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, sizes: list[int], max_pages_per_seq: int, max_seq_len: int,
                 vocab_size: int, pad_page: int, device: torch.device):
        self.model, self.sizes, self.device = model, sorted(set(sizes)), device
        self.max_seq_len, self.pad_page = max_seq_len, pad_page
        n = self.sizes[-1]
        with device:
            self.input_ids = torch.zeros(n, dtype=torch.int64)
            self.positions = torch.zeros(n, dtype=torch.int64)
            self.slot_mapping = torch.full((n,), -1, dtype=torch.int64)
            self.seq_lens = torch.ones(n, dtype=torch.int32)
            self.page_table = torch.full((n, max_pages_per_seq), pad_page, dtype=torch.int32)
            self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32)
            self.rows = torch.arange(n, dtype=torch.int64)
            self.logits = torch.zeros(n, vocab_size, dtype=torch.float32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def capture(self) -> dict[int, float]:
        """Capture every size, largest first (later ones reuse its pool). Returns seconds per size.

        The new graphs replace the old ones only when every size captured; on failure the old graphs
        (and the code they were captured from) keep serving.
        """
        graphs, timings = {}, {}
        for size in reversed(self.sizes):
            start = time.perf_counter()
            if self.device.type == "cuda":
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self._forward(size)
                self.pool = graph.pool()
                graphs[size] = graph
            timings[size] = time.perf_counter() - start
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.graphs = graphs
        return timings

    def run(self, input_ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
            page_table: list[list[int]]) -> torch.Tensor:
        """Logits [n, V] for a decode batch of n <= max_size sequences."""
        n = len(input_ids)
        size = next(s for s in self.sizes if s >= n)
        self._fill(self.input_ids, input_ids, size, 0)
        self._fill(self.positions, positions, size, 0)
        self._fill(self.slot_mapping, slots, size, -1)
        self._fill(self.seq_lens, seq_lens, size, 1)
        width = self.page_table.shape[1]
        rows = [pages + [self.pad_page] * (width - len(pages)) for pages in page_table]
        self.page_table[:n].copy_(torch.tensor(rows, dtype=torch.int32), non_blocking=True)
        self.page_table[n:size].fill_(self.pad_page)
        if size in self.graphs:
            self.graphs[size].replay()
        else:
            self._forward(size)
        return self.logits[:n]

    def _fill(self, buffer: torch.Tensor, values: list[int], size: int, pad: int) -> None:
        n = len(values)
        buffer[:n].copy_(torch.tensor(values, dtype=buffer.dtype), non_blocking=True)
        buffer[n:size].fill_(pad)

    def _forward(self, size: int) -> None:
        set_context(Context(
            cu_seqlens_q=self.cu_seqlens_q[: size + 1], seq_lens=self.seq_lens[:size],
            page_table=self.page_table[:size], slot_mapping=self.slot_mapping[:size],
            logits_indices=self.rows[:size], max_q_len=1, max_seq_len=self.max_seq_len,
        ))
        try:
            hidden = self.model(self.input_ids[:size], self.positions[:size])
            self.logits[:size] = self.model.compute_logits(hidden)
        finally:
            set_context(None)

"""Decode steps replayed from CUDA graphs, one graph per batch size in one shared memory pool.

A decode batch of n sequences runs the graph of the smallest captured size >= n; the extra rows are
padding (slot -1: they write no KV; their logits are dropped). Inputs live in static buffers that each
step overwrites. A reload captures only the sizes the steps used since the last capture (`capture(sizes)`); the
others are pending, captured one at a time between steps once serving resumed (`capture_next`; AsyncEngine
decides when), and run eagerly until then. On CPU nothing is captured and `run` executes the same padded static batch
eagerly, so CPU tests exercise everything but the capture itself. A step under other capture-time properties
(`graph_properties`) than the capture's runs eagerly rather than replaying the wrong kernels.
"""
import contextlib
import gc
import os
import time

import numpy as np
import torch

from tsdev_kernels.ops.attention import longest_first
from tsdev_runtime.context import Context, step_context


def graph_properties() -> tuple:
    """What a capture depends on besides the code: a forward under other properties runs eagerly."""
    return os.environ.get("TSDEV_KERNELS", "triton"), torch.is_inference_mode_enabled()


@contextlib.contextmanager
def collector_paused():
    """Keep Python's cyclic garbage collector off while capturing: a CUDA graph in a garbage cycle (an earlier
    engine's) freed mid-capture resets itself inside the capture and invalidates it (seen on the H200: "operation
    not permitted when stream is capturing (function reset)", then a failed cuBLAS call). Collected after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def end_pool_routing(pool: tuple, device: torch.device) -> None:
    """After a capture that failed, make sure torch's allocator no longer routes allocations into the graph's pool.
    A failed `capture_end` can leave that routing in place (torch 2.11), and from then on `empty_cache` releases
    nothing (on the H200, after the fallback to eager prefill, sleep freed 0.16 of 9 GB). A no-op if it ended.
    Prefill's capture calls it (the decode capture's case: docs/runtime.md, "On the GPU")."""
    try:
        torch._C._cuda_endAllocateToPool(torch.device(device).index or 0, pool)
    except RuntimeError:  # not routing into that pool any more: capture_end did end it
        pass


class GraphSet:
    """What both graph kinds (decode batch sizes here, prefill token buckets in prefill_graphs.py) keep: one graph
    per size, the sizes the steps ran since the last capture (`used`: a reload captures those before resuming)
    and those left to capture (`pending`, largest first, one at a time between steps)."""

    def __init__(self, sizes: list[int]):
        self.sizes = sorted(set(sizes))
        self.graphs: dict = {}
        self.used: set[int] = set()
        self.pending: list[int] = []

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def size_for(self, n: int) -> int | None:
        """The smallest size that holds n rows (None: none does)."""
        return next((s for s in self.sizes if s >= n), None)

    def cuda_graphs(self) -> list[torch.cuda.CUDAGraph]:
        """Every captured CUDA graph (what a kernel-only reload patches)."""
        raise NotImplementedError

    def _to_capture(self, sizes: list[int] | None) -> list[int]:
        """`sizes` (default: all) that this set has, largest first: later ones reuse its pool."""
        return sorted(set(self.sizes if sizes is None else sizes) & set(self.sizes), reverse=True)

    def _drop(self) -> None:
        """No graph and nothing pending: every size runs eagerly until the next `capture`."""
        self.graphs, self.pending = {}, []

    def _replace(self, graphs: dict) -> None:
        """A capture's graphs replace every old one (None: that size failed, eager); the sizes it did not capture
        are pending."""
        self.graphs = {s: g for s, g in graphs.items() if g is not None}
        self.pending, self.used = [s for s in reversed(self.sizes) if s not in graphs], set()


class _Staging:
    """A step's inputs on the host, as int32 words (pinned on CUDA: the copy to the device is a plain asynchronous DMA)
    and, on CUDA, the event recorded after each copy (one event, recorded again each time): the buffer is not written
    again before the copy read it."""

    def __init__(self, words: int, on_cuda: bool):
        self.buffer = torch.zeros(words, dtype=torch.int32, pin_memory=on_cuda)
        self.words = self.buffer.numpy()
        self.copied = torch.cuda.Event() if on_cuda else None  # synchronize() before a record returns at once

    def reusable(self) -> np.ndarray:
        if self.copied is not None:
            self.copied.synchronize()  # two steps ago: done unless the GPU fell two steps behind
        return self.words


class DecodeGraphs(GraphSet):
    def __init__(self, model: torch.nn.Module, sizes: list[int], max_pages_per_seq: int,
                 vocab_size: int, pad_page: int, device: torch.device):
        super().__init__(sizes)
        self.model, self.device, self.pad_page = model, device, pad_page
        n = self.sizes[-1]
        # One copy from the host per step, into `transfer`: five int64 rows of `size` (input ids, positions, KV slots,
        # sequence lengths, the order attention starts the sequences in: the graph of that size reads them there),
        # then the page table's changed block (rows x columns, often none), which a device copy puts into `page_table`.
        words = 10 * n + n * max_pages_per_seq
        with device:
            self.transfer = torch.zeros(words, dtype=torch.int32)
            self.page_table = torch.full((n, max_pages_per_seq), pad_page, dtype=torch.int32)
            self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32)
            self.rows = torch.arange(n, dtype=torch.int64)
            self.logits = torch.zeros(n, vocab_size, dtype=torch.float32)
        self.properties: tuple = ()
        self.pool = None
        # Two staging buffers used in turn: the host fills one while the other's copy may wait behind the step in
        # flight.
        self.staging = [_Staging(words, device.type == "cuda") for _ in range(2)]
        self.turn = 0
        # The page table is updated incrementally: a host mirror, and which page list each row holds.
        self.host_table = np.full((n, max_pages_per_seq), pad_page, dtype=np.int32)
        self.row_pages: list[list[int] | None] = [None] * n
        self.row_filled = [0] * n
        self.stale = (0, 0)

    def _inputs(self, size: int) -> torch.Tensor:
        """The five input rows [5, size] that the graph of `size` reads."""
        return self.transfer[: 10 * size].view(torch.int64).view(5, size)

    def cuda_graphs(self) -> list[torch.cuda.CUDAGraph]:
        return list(self.graphs.values())

    def capture(self, sizes: list[int] | None = None) -> dict[int, float]:
        """Capture `sizes` (default every size), largest first (later ones reuse its pool); seconds per size.

        The new graphs replace every old one (they run the old code) only when all of `sizes` captured; on
        failure the old graphs keep serving. The sizes not captured now are pending (`capture_next`).
        """
        graphs, timings = {}, {}
        with torch.inference_mode(), collector_paused():  # inference mode: as the engine's steps run
            properties = graph_properties()
            for size in self._to_capture(sizes):
                start = time.perf_counter()
                graphs[size] = self._capture(size)
                timings[size] = time.perf_counter() - start
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._replace(graphs)
        self.properties = properties
        return timings

    def capture_next(self) -> dict[int, float]:
        """Capture the largest pending size: {size: seconds}. A failure raises and leaves that size eager."""
        size = self.pending.pop(0)
        start = time.perf_counter()
        with torch.inference_mode(), collector_paused():
            if self.properties != graph_properties():  # captured under other properties: none replays now
                self.pending = []
                return {}
            graph = self._capture(size)
        if graph is not None:
            torch.cuda.synchronize(self.device)
            self.graphs[size] = graph
        return {size: time.perf_counter() - start}

    def _capture(self, size: int) -> "torch.cuda.CUDAGraph | None":
        if self.device.type != "cuda":
            return None
        graph = torch.cuda.CUDAGraph(keep_graph=True)  # its nodes: a kernel-only reload patches them (graph_patch)
        with torch.cuda.graph(graph, pool=self.pool):
            self._forward(size)
        graph.instantiate()
        self.pool = graph.pool()
        return graph

    def release(self) -> None:
        """Drop every graph and their pool (sleep): their memory goes back once the allocator's cache is emptied.
        Until `capture` runs again, `run` executes eagerly."""
        self._drop()
        self.properties, self.pool = (), None

    def run(self, input_ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
            page_table: list[list[int]], fill=None) -> torch.Tensor:
        """Logits [n, V] for a decode batch of n <= max_size sequences. `fill` (model_runner.PendingTokens): inputs
        the previous step is still sampling, written in on the device after the host's staged ids."""
        n = len(input_ids)
        size = self.size_for(n)
        self.used.add(size)
        stage = self.staging[self.turn]
        self.turn ^= 1
        words = stage.reusable()
        rows = words[: 10 * size].view(np.int64).reshape(5, size)
        for row, values, pad in ((0, input_ids, 0), (1, positions, 0), (2, slots, -1), (3, seq_lens, 1)):
            rows[row, :n], rows[row, n:] = values, pad
        rows[4] = longest_first(seq_lens, size)
        for row, pages in enumerate(page_table):
            self._update_row(row, pages)
        for row in range(n, size):  # padding rows (length 1) read column 0 alone
            self._update_row(row, None)
        # the page table's changed block, if any (at batch 1, a new page every page_size steps)
        stale_rows, stale_cols = self.stale
        end = 10 * size + stale_rows * stale_cols
        if stale_rows:
            words[10 * size : end].reshape(stale_rows, stale_cols)[:] = self.host_table[:stale_rows, :stale_cols]
        self.transfer[:end].copy_(stage.buffer[:end], non_blocking=True)
        if stage.copied is not None:
            stage.copied.record()
        if stale_rows:
            self.page_table[:stale_rows, :stale_cols].copy_(self.transfer[10 * size : end].view(stale_rows, stale_cols))
            self.stale = (0, 0)
        if fill is not None:
            fill.write(self._inputs(size)[0])
        if size in self.graphs and self.properties == graph_properties():
            self.graphs[size].replay()
        else:
            self._forward(size)
        return self.logits[:n]

    def _update_row(self, row: int, pages: list[int] | None) -> None:
        """Write only what changed: a row that keeps its sequence gets its new pages appended. What is written is
        stale on the device until the next copy (`stale`: the rows and columns that copy must cover)."""
        if pages is None:
            if self.row_pages[row] is not None:
                self.stale = (max(self.stale[0], row + 1), max(self.stale[1], 1))
                self.row_pages[row], self.row_filled[row] = None, 0
                self.host_table[row, 0] = self.pad_page
            return
        start = self.row_filled[row] if self.row_pages[row] is pages else 0
        if start < len(pages):
            self.stale = (max(self.stale[0], row + 1), max(self.stale[1], len(pages)))
            self.host_table[row, start : len(pages)] = pages[start:]
        self.row_pages[row], self.row_filled[row] = pages, len(pages)

    def _forward(self, size: int) -> None:
        input_ids, positions, slots, seq_lens, order = self._inputs(size)
        with step_context(Context(cu_seqlens_q=self.cu_seqlens_q[: size + 1], seq_lens=seq_lens.to(torch.int32),
                                  page_table=self.page_table[:size], slot_mapping=slots,
                                  logits_indices=self.rows[:size], max_q_len=1, order=order)):
            hidden = self.model(input_ids, positions)
            self.model.compute_logits(hidden, out=self.logits[:size])

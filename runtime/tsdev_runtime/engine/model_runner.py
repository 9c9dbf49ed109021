"""Owns the model, the KV pool and the sampler; turns a scheduled batch into sampled tokens."""
import contextlib
import dataclasses
import logging
import math
import random
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import nvtx
import torch

from tsdev_kernels.ops import check_kernel_choices
from tsdev_kernels.ops.attention import split_order
from tsdev_kernels.ops.fp8 import fp8_unsupported_reason
from tsdev_runtime import distributed
from tsdev_runtime.config import EngineConfig, ModelConfig
from tsdev_runtime.context import Context, step_context
from tsdev_runtime.engine import graph_patch
from tsdev_runtime.engine.cuda_graphs import DecodeGraphs
from tsdev_runtime.engine.prefill_graphs import PrefillGraphs, prefill_buckets
from tsdev_runtime.engine.scheduler import ScheduledBatch
from tsdev_runtime.engine.sleep import SleepState, device_free_bytes, free_cached_memory, unique_storages
from tsdev_runtime.engine.sequence import PENDING, SamplingParams, Sequence
from tsdev_runtime.layers.attention import Attention
from tsdev_runtime.models import MODELS, build_model
from tsdev_kernels.ops.sampling import token_logprobs
from tsdev_runtime.sampling.sampler import Extras, Sampled, Sampler, SamplerState
from tsdev_runtime.weights.default_model import DEFAULT_NAMES, EMBEDDED_NAMES, default_model_dir
from tsdev_runtime.weights.hub import not_a_model
from tsdev_runtime.weights.layout import named_tensors
from tsdev_runtime.weights import handover
from tsdev_runtime.weights.loader import LoadedWeights, LoadReport, adopt_weights, load_weights

CPU_KV_BYTES = 512 << 20
NVTX_DOMAIN = "tsdev"
MAX_DEFAULT_MODEL_LEN = 8192


@dataclass
class PendingTokens:
    """Inputs the step in flight is still sampling: their rows in this step's input ids (increasing) and where each
    one's token sits among that step's sampled tokens (on the device)."""
    rows: list[int]
    sources: list[int]
    tokens: torch.Tensor

    def write(self, input_ids: torch.Tensor) -> None:
        """Into `input_ids` (on the device): one slice copy where both sides are consecutive (a steady decode batch),
        else an indexed copy."""
        k, first, source = len(self.rows), self.rows[0], self.sources[0]
        if self.rows[-1] - first == k - 1 and self.sources == list(range(source, source + k)):
            input_ids[first : first + k].copy_(self.tokens[source : source + k])
            return
        pinned = input_ids.device.type == "cuda"
        rows, sources = (torch.tensor(values, dtype=torch.int64, pin_memory=pinned).to(input_ids.device,
                                                                                        non_blocking=True)
                         for values in (self.rows, self.sources))
        input_ids.index_copy_(0, rows, self.tokens.index_select(0, sources))


def step_range(name: str):
    """The NVTX range `name` in the tsdev domain (nsys's step table). While a torch profiler records, also
    a `record_function` label "tsdev:name" (the torch trace's step table); otherwise that costs one check."""
    if torch.autograd._profiler_enabled():
        return _recorded_range(name)
    return nvtx.annotate(name, domain=NVTX_DOMAIN)


@contextlib.contextmanager
def _recorded_range(name: str):
    with nvtx.annotate(name, domain=NVTX_DOMAIN), torch.profiler.record_function(f"{NVTX_DOMAIN}:{name}"):
        yield


@dataclass(frozen=True)
class Checkpoint:
    """The checkpoint an engine config names, checked before any weight loads."""
    dir: Path
    config: ModelConfig
    max_model_len: int  # what --max-model-len asks for, else the model's, capped at MAX_DEFAULT_MODEL_LEN

    @classmethod
    def open(cls, config: EngineConfig) -> "Checkpoint":
        if config.model in DEFAULT_NAMES:
            model_dir = default_model_dir(config.device, config.model)
        else:
            model_dir = Path(config.model)
        if not model_dir.is_dir():
            raise FileNotFoundError(not_a_model(str(model_dir), EMBEDDED_NAMES))
        model_config = ModelConfig.from_dir(model_dir, MODELS)
        max_model_len = config.max_model_len
        if max_model_len is None:
            max_model_len = min(model_config.max_position_embeddings, MAX_DEFAULT_MODEL_LEN)
        if max_model_len < 2:  # a prompt token and a generated one (the warm-up runs max_model_len - 1)
            raise ValueError(f"--max-model-len must be at least 2 (got {max_model_len})")
        if max_model_len > model_config.max_position_embeddings:
            raise ValueError(f"--max-model-len {max_model_len} exceeds the model's "
                             f"max_position_embeddings {model_config.max_position_embeddings}")
        return cls(model_dir, model_config, max_model_len)


progress = logging.getLogger("tsdev_runtime.startup")  # runtime/tsdev_runtime/engine/compiles.py: what a start is doing


def loaded_model(model_config: ModelConfig, model_dir: Path, config: EngineConfig, device: torch.device,
                 dtype: torch.dtype) -> LoadedWeights:
    """The model built as `config` says (quantization), `model_dir`'s checkpoint loaded into it -- or the tensors the
    server this one replaces handed over, where they are what the read would give (`handover.take`) --, in eval
    mode."""
    progress.info("building %s on %s", model_config.architecture, device)
    model = build_model(model_config, device, dtype, config.quantization)
    handed, why_not = handover.take(model_dir, config)
    weights = None
    if handed is not None:
        progress.info("copying the weights the stopped server handed over")
        try:
            weights = adopt_weights(model, handed.tensors, handed.seconds)
        except ValueError as exc:
            why_not = str(exc)
        handed.tensors.clear()  # the copies' memory back before the KV pool is sized from what is free
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if weights is None:
        progress.info("loading the weights from %s%s", model_dir, f" ({why_not})" if why_not else "")
        weights = load_weights(model, model_dir, config.load_format, config.load_memory_limit)
    if why_not:
        weights.report = dataclasses.replace(weights.report, detail=f"not handed over: {why_not}")
    weights.fingerprint = handover.fingerprint(model_dir, config) if config.world_size == 1 else None
    model.eval()
    return weights


class ModelRunner:
    """Benchmarks that time the runner alone build their own: `ModelRunner(config, Checkpoint.open(config))`,
    then `start()`; the engine builds one the same way."""

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint):
        model_config, max_model_len = checkpoint.config, checkpoint.max_model_len
        self.config, self.model_config = config, model_config
        check_kernel_choices()  # a bad TSDEV_KERNELS fails here, on any device, before the weights load
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype(model_config)
        torch.manual_seed(config.seed)
        self.weights = loaded_model(model_config, checkpoint.dir, config, self.device, self.dtype)
        self.model, self.load_report = self.weights.model, self.weights.report
        self.sampler = Sampler()
        # one slot per running request that uses penalties or logit_bias, and a scratch slot for the warm-up
        self.sampler_state = SamplerState(config.max_running + 1, model_config.vocab_size, self.device)
        self.eos_token_ids = list(model_config.eos_token_ids)
        self.max_model_len = max_model_len
        self.kv_cache = self._allocate_kv_cache(max_model_len)
        self.rng = random.Random(config.seed)
        self.sleep_state = SleepState()
        self._graphs_released = False  # by a full weight update that has not recaptured yet
        self.forward_started = None  # CUDA: the last step's `_mark_forward` event
        self.decode_graphs = self.prefill_graphs = None
        sizes = [s for s in config.cudagraph_capture_sizes if s <= config.max_running]
        if sizes and not config.enforce_eager:
            self.decode_graphs = DecodeGraphs(self.model, sizes, -(-max_model_len // config.page_size),
                                              model_config.vocab_size, self.scratch_pages[0], self.device)
        buckets = prefill_buckets(min(config.prefill_graph_max_tokens, max_model_len), config.max_batched_tokens,
                                  config.prefill_graph_capture_sizes)  # (a longer step, of several prompts, is eager)
        if buckets and not config.enforce_eager:
            self.prefill_graphs = PrefillGraphs(self.model, buckets, model_config.hidden_size, self.dtype, self.device)

    @property
    def num_pages(self) -> int:
        """Pages the block manager may hand out (the scratch pages after them are for warm-up and padding)."""
        return self.kv_cache.shape[2] - len(self.scratch_pages)

    def rebuild_model(self, model_dir: Path) -> LoadedWeights:
        """A reload changed a layer's `__init__` or post-load hook: build the model again with the code now
        loaded (on the device, beside the old one: a second copy of the weights until the reload commits),
        load `model_dir`'s checkpoint into it, run the post-load hooks, and serve it (same KV pool). Returns
        the old model's weights for `restore_model`. Raises ValueError, changing nothing, when the checkpoint no
        longer fits the new code (a parameter's shape changed)."""
        weights = loaded_model(self.model_config, model_dir, self.config, self.device, self.dtype)
        old = self.weights
        self.restore_model(weights)
        return old

    def restore_model(self, weights: LoadedWeights) -> None:
        """Serve `weights`' model: its attention layers get the KV pool's views; the graphs run it (recapture them)."""
        self.weights = weights
        model = self.model = weights.model
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        for layer, layer_kv in zip(layers, self.kv_cache):
            layer.bind(layer_kv)
        if self.decode_graphs is not None:
            self.decode_graphs.model = model
        if self.prefill_graphs is not None:
            self.prefill_graphs.model, self.prefill_graphs.attention = model, layers

    def _allocate_kv_cache(self, max_model_len: int) -> torch.Tensor:
        page = self.config.page_size
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        layouts = {layer.cache_layout() for layer in layers}  # (caches, heads, values) per token: this rank's
        if len(layouts) != 1:
            raise ValueError(f"the model's attention layers keep different caches ({sorted(layouts)}): one KV pool "
                             "holds one layout")
        layout = layouts.pop()
        kv_dtype = self.config.kv_torch_dtype(self.dtype)
        if kv_dtype == torch.float8_e4m3fn and (why := fp8_unsupported_reason(self.device, "--kv-cache-dtype fp8")):
            raise ValueError(why)
        page_bytes = len(layers) * page * math.prod(layout) * kv_dtype.itemsize
        num_pages, memory = self.config.kv_pages, ""
        if num_pages is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                total = torch.cuda.get_device_properties(self.device).total_memory
                budget = free - (1 - self.config.gpu_memory_utilization) * total - (1 << 30)  # 1 GiB for activations
                memory = (f" ({free / 2**30:.1f} of the GPU's {total / 2**30:.1f} GiB are free after the weights, "
                          f"--gpu-memory-utilization {self.config.gpu_memory_utilization} keeps "
                          f"{(1 - self.config.gpu_memory_utilization) * total / 2**30:.1f} GiB back and activations "
                          "1 GiB; other processes on this GPU hold the rest)")
            else:
                budget = CPU_KV_BYTES
            num_pages = max(0, min(int(budget // page_bytes), self.config.max_running * -(-max_model_len // page)))
        num_pages = distributed.minimum(num_pages)  # rank 0 hands out pages every rank must hold
        if num_pages * page < max_model_len:
            raise ValueError(
                f"the KV pool ({num_pages} pages of {page} tokens) cannot hold one sequence of max_model_len "
                f"{max_model_len}{memory}: free the GPU, raise --gpu-memory-utilization or --kv-pages, or lower "
                "--max-model-len"
            )
        scratch = -(-min(self.config.max_batched_tokens, max_model_len) // page) + 1
        self.scratch_pages = list(range(num_pages, num_pages + scratch))
        caches, heads, values = layout
        kv = torch.zeros(len(layers), caches, num_pages + scratch, page, heads, values, dtype=kv_dtype,
                         device=self.device)
        for layer, layer_kv in zip(layers, kv):
            layer.bind(layer_kv)
        return kv

    def host_inputs(self, batch: ScheduledBatch) -> dict[str, list]:
        """The batch flattened into plain lists: one row per token this step computes. `pending` lists
        the rows whose token is still being sampled by the step in flight (their id is 0 here)."""
        page = self.config.page_size
        input_ids, positions, slots, cu, seq_lens, logits_indices, pending = [], [], [], [0], [], [], []
        prompt_rows = {i: (first, count) for i, first, count in batch.prompt_rows}
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids = seq.step_tokens(n)
            if ids[-1] == PENDING:  # only ever the last token
                ids[-1] = 0
                pending.append((len(input_ids) + n - 1, seq))
            input_ids += ids
            positions += range(start, end)
            slots += [seq.pages[p // page] * page + p % page for p in range(start, end)]
            if i in prompt_rows:  # the prompt positions whose logprobs it asked for, before its sampled row
                first, count = prompt_rows[i]
                logits_indices += range(cu[-1] + first - start, cu[-1] + first - start + count)
            cu.append(cu[-1] + n)
            seq_lens.append(end)
            if batch.sample_rows[i]:
                logits_indices.append(cu[-1] - 1)
        return dict(input_ids=input_ids, positions=positions, slots=slots, cu_seqlens_q=cu, seq_lens=seq_lens,
                    logits_indices=logits_indices, page_table=[s.pages for s in batch.seqs], pending=pending)

    def _pending_fill(self, pending: list[tuple[int, Sequence]], in_flight) -> "PendingTokens | None":
        """The rows whose input the step in flight samples. `in_flight` is that step's (device tokens, sequence ->
        index in them)."""
        if not pending:
            return None
        if in_flight is None:
            raise RuntimeError("a sequence ends in a PENDING token but no step is in flight")
        tokens, index = in_flight
        return PendingTokens([r for r, _ in pending], [index[s] for _, s in pending], tokens)

    def prepare(self, batch: ScheduledBatch, in_flight=None) -> tuple[torch.Tensor, torch.Tensor, Context]:
        """Input ids, positions and the step context on the device, for a forward outside the decode graphs."""
        inputs = self.host_inputs(batch)
        max_pages = max(map(len, inputs["page_table"]))
        table = [pages + [0] * (max_pages - len(pages)) for pages in inputs["page_table"]]

        def tensor(values, dtype=torch.int32):
            return torch.tensor(values, dtype=dtype, pin_memory=self.device.type == "cuda").to(
                self.device, non_blocking=True)

        decodes, order = split_order(batch.num_tokens, inputs["seq_lens"])
        context = Context(
            cu_seqlens_q=tensor(inputs["cu_seqlens_q"]), seq_lens=tensor(inputs["seq_lens"]), page_table=tensor(table),
            slot_mapping=tensor(inputs["slots"], torch.int64),
            logits_indices=tensor(inputs["logits_indices"], torch.int64),
            max_q_len=max(batch.num_tokens), order=tensor(order, torch.int64),
            q_lens=list(batch.num_tokens), seq_lens_host=inputs["seq_lens"], decodes=decodes,
        )
        input_ids = tensor(inputs["input_ids"], torch.int64)
        fill = self._pending_fill(inputs["pending"], in_flight)
        if fill is not None:
            fill.write(input_ids)
        return input_ids, tensor(inputs["positions"], torch.int64), context

    @torch.inference_mode()
    def compute_logits(self, batch: ScheduledBatch, use_graphs: bool = True, in_flight=None) -> torch.Tensor:
        """Logits [S, V] (float32) of the rows this batch samples from; valid until the next step (graph
        replays return a view of their static output buffer). Without `use_graphs`, a plain eager forward.
        `in_flight`: (device tokens, sequence -> index) of the step still running, for PENDING inputs."""
        graphs = self.decode_graphs
        # Decode graphs: one token per row, every row sampling (a one-token prefill chunk that does not reach
        # its prompt's end samples nothing, and the graph's logits are per row).
        if (use_graphs and graphs and max(batch.num_tokens) == 1 and all(batch.sample_rows)
                and len(batch.seqs) <= graphs.max_size):
            with step_range("prepare"):
                inputs = self.host_inputs(batch)
                fill = self._pending_fill(inputs["pending"], in_flight)
            with step_range("forward"):
                self._mark_forward()
                return graphs.run(inputs["input_ids"], inputs["positions"], inputs["slots"], inputs["seq_lens"],
                                  inputs["page_table"], fill)
        with step_range("prepare"):
            input_ids, positions, context = self.prepare(batch, in_flight)
        with step_range("forward"), step_context(context):
            self._mark_forward()
            prefill = self.prefill_graphs
            if use_graphs and prefill and not prefill.disabled and batch.total_tokens <= prefill.max_tokens:
                hidden = prefill.forward(input_ids, positions)
            else:
                hidden = self.model(input_ids, positions)
            return self.model.compute_logits(hidden)

    def _mark_forward(self) -> None:
        """On CUDA, `forward_started`: a timing event after the step's inputs were prepared on the host, before its
        forward (the engine counts the GPU idle until then: LLMEngine._time_gpu)."""
        if self.device.type == "cuda":
            self.forward_started = torch.cuda.Event(enable_timing=True)
            self.forward_started.record()

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, in_flight=None, use_graphs: bool = True) -> Sampled | None:
        """One forward + sampling, without waiting for the GPU: the sampled token ids [S] (on the device) of
        the sequences that sample, in batch order, with the logprobs asked for; None if nothing is sampled."""
        logits = self.compute_logits(batch, use_graphs, in_flight)
        sampling = batch.sampling
        if not sampling and not batch.prompt_rows:
            return None
        with step_range("sample"):
            prompt = None
            if batch.prompt_rows:
                logits, prompt = self.prompt_logprobs(batch, logits)
            sampled = self.sample(logits, sampling) if sampling else Sampled(logits.new_empty(0, dtype=torch.int64))
            sampled.prompt_logprobs = prompt
            return sampled

    def prompt_logprobs(self, batch: ScheduledBatch, logits: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        """Split the logits of a step with prompt rows (`host_inputs` puts each sequence's before its sampled
        row) into the sampled rows' and the prompt positions' logprobs of the next prompt token (with the top-N
        the requests asked for), in batch.prompt_rows order."""
        prompt_rows = {i: (first, count) for i, first, count in batch.prompt_rows}
        rows, targets, sampled, r = [], [], [], 0
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            if i in prompt_rows:
                first, count = prompt_rows[i]
                offset = first - seq.num_computed_tokens
                rows += range(r, r + count)
                targets += seq.step_tokens(n + 1)[offset + 1 : offset + 1 + count]
                r += count
            if batch.sample_rows[i]:
                sampled.append(r)
                r += 1
        top_n = max(batch.seqs[i].params.prompt_logprobs for i, _, _ in batch.prompt_rows)

        def index(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(logits.device, non_blocking=True)

        prompt = token_logprobs(logits[index(rows)], index(targets), top_n)
        return logits[index(sampled)], prompt

    def run(self, batch: ScheduledBatch, use_graphs: bool = True) -> list[int]:
        """`launch`, then wait: the sampled tokens as a list."""
        sampled = self.launch(batch, use_graphs=use_graphs)
        return [] if sampled is None else sampled.tokens.tolist()

    @torch.inference_mode()
    def warmup(self) -> float:
        """Run dummy prefill and decode batches (on scratch pages) so every kernel is compiled and tuned.

        Startup and the reload's warm step run exactly this.
        """
        start = time.perf_counter()
        page = self.config.page_size
        longest = min(self.config.max_batched_tokens, self.max_model_len - 1, len(self.scratch_pages) * page)
        greedy = SamplingParams(max_tokens=1, temperature=0)
        sampled = SamplingParams(max_tokens=1, temperature=0.8, top_k=20, top_p=0.9, seed=0)

        def dummy(length: int, computed: int, params: SamplingParams) -> Sequence:
            seq = Sequence("warmup", [(7 * i) % self.model_config.vocab_size for i in range(length)], params)
            seq.pages = self.scratch_pages[: -(-length // page)]
            seq.num_computed_tokens = computed
            return seq

        # prefill, eagerly: a long prompt; then a short one with one that has a cached prefix (48 tokens: a
        # multiple of 16 like the graph buckets, where Triton specialises integer arguments differently)
        self.run(ScheduledBatch([dummy(longest, 0, greedy)], [longest]), use_graphs=False)
        lengths = [min(17, longest), min(40, longest)]
        computed = [0, max(lengths[1] - 31, 0)]
        seqs = [dummy(n, c, p) for n, c, p in zip(lengths, computed, (sampled, greedy))]
        self.run(ScheduledBatch(seqs, [n - c for n, c in zip(lengths, computed)]), use_graphs=False)
        # decode, eagerly, at batch 1, 2 (one and a few rows take other projection kernels) and the largest
        # batch the graphs will serve
        largest = self.decode_graphs.max_size if self.decode_graphs else self.config.max_running
        for size in sorted({1, min(2, largest), largest}):
            seqs = [dummy(min(100 + i, longest), min(100 + i, longest) - 1, sampled if i % 2 else greedy)
                    for i in range(size)]
            batch = ScheduledBatch(seqs, [1] * size)
            logits = self.compute_logits(batch, use_graphs=False)
            self.sample(logits, seqs)
        self.sampler.warm(logits[:1], self.sampler_state)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def prepare_thread(self) -> None:
        """Make the calling thread's cuBLAS and cuBLASLt handles. A graph capture cannot create them
        (CUBLAS_STATUS_NOT_INITIALIZED), and the engine's thread may have only replayed graphs before a reload or a
        wake-up captures on it. The forward's kinds of matmul on 16 x 16 inputs; no collective: each rank its own."""
        if self.device.type != "cuda":
            return
        a = torch.ones(16, 16, dtype=self.dtype, device=self.device)
        torch.nn.functional.linear(a, a, a[0])  # with a bias: torch may take cuBLASLt for it
        if self.dtype in (torch.bfloat16, torch.float16):
            torch.mm(a, a, out_dtype=torch.float32)  # the logits' matmul
        if self.config.quantization == "fp8":
            from tsdev_kernels.ops.fp8 import fp8_scaled_mm

            fp8_scaled_mm(a, a.to(torch.float8_e4m3fn), torch.ones(16, device=self.device))
        torch.cuda.synchronize(self.device)

    def start(self) -> dict[str, float]:
        """Warm up, then capture the graphs (a prefill capture failure leaves prefill eager): seconds of
        warm-up (`warm`), decode graphs (`capture`) and prefill graphs (`capture_prefill`)."""
        progress.info("warm-up: running every kernel serving reaches (a fresh machine compiles them now)")
        warm = self.warmup()
        sizes = self.decode_graphs.sizes if self.decode_graphs else []
        buckets = self.prefill_graphs.buckets if self.prefill_graphs else []
        first = (self._first(sizes, self.config.cudagraph_capture_first),
                 self._first(buckets, self.config.prefill_graph_capture_first))  # None: all of them
        if self.device.type == "cuda":
            progress.info("capturing %d decode and %d prefill graph(s) before serving",
                          *(len(all_ if now is None else now) for all_, now in zip((sizes, buckets), first)))
        elif sizes or buckets:  # the same bookkeeping, nothing captured: the steps run eagerly
            progress.info("no CUDA graphs on %s: decode and prefill run eagerly", self.device.type)
        graphs = self.capture_graphs(strict=False, first=first)
        return {"warm": warm, "capture": sum(graphs["decode"].values()),
                "capture_prefill": sum(graphs["prefill"].values())}

    @staticmethod
    def _first(sizes: list[int] | None, wanted: list[int] | None) -> list[int] | None:
        """Of `sizes`, those `wanted` (at least the smallest, which shows the code captures); all when None."""
        if not sizes or wanted is None:
            return None
        return sorted(set(sizes) & set(wanted)) or sizes[:1]

    def capture_graphs(self, strict: bool = True, first: tuple[list[int], list[int]] | None = None
                       ) -> dict[str, dict[int, float]]:
        """(Re)capture the decode graphs, then the prefill graphs: seconds per batch size and per token
        bucket. A no-op per size on CPU. A prefill capture failure other than out-of-memory raises when
        `strict` (a reload), else leaves prefill eager (startup). `first` (a reload: `used_graphs()`): only
        these decode sizes and prefill buckets now; the others are pending, for `capture_next`."""
        sizes, buckets = first or (None, None)
        return {"decode": self.decode_graphs.capture(sizes) if self.decode_graphs else {},
                "prefill": self.prefill_graphs.capture(strict, buckets) if self.prefill_graphs else {}}

    def patch_graphs(self, swaps: Mapping[int, tuple[int, int, int]]) -> int:
        """Point the captured graphs' kernel nodes at new binaries (runtime/tsdev_runtime/engine/graph_patch.py): nodes
        patched. GraphPatchError (nothing changed) when the driver refuses one."""
        sets = [s for s in (self.decode_graphs, self.prefill_graphs) if s is not None]
        graphs = [graph for graph_set in sets for graph in graph_set.cuda_graphs()]
        return graph_patch.patch(graphs, swaps) if graphs else 0  # none (the CPU, eager): the driver is not asked

    def used_graphs(self) -> tuple[list[int], list[int]]:
        """The decode sizes and prefill buckets the steps ran since the last capture (at least the smallest of
        each: a reload captures one of each kind, which tests that the new code captures)."""
        decode, prefill = self.decode_graphs, self.prefill_graphs
        return (sorted(decode.used or decode.sizes[:1]) if decode else [],
                sorted(prefill.used or prefill.buckets[:1]) if prefill else [])

    @property
    def graphs_pending(self) -> int:
        """How many graphs `capture_next` has left to capture."""
        return sum(len(g.pending) for g in (self.decode_graphs, self.prefill_graphs) if g is not None)

    def capture_next(self) -> dict[str, dict[int, float]]:
        """Capture one pending graph (decode sizes first): {kind: {size: seconds}}, empty dicts when that
        capture failed (it stays eager)."""
        if self.decode_graphs is not None and self.decode_graphs.pending:
            return {"decode": self.decode_graphs.capture_next(), "prefill": {}}
        return {"decode": {}, "prefill": self.prefill_graphs.capture_next()}

    def release_graphs(self) -> None:
        """Free the decode and prefill graphs and their pools (sleep); steps run eagerly until `capture_graphs`."""
        for graphs in (self.decode_graphs, self.prefill_graphs):
            if graphs is not None:
                graphs.release()

    def sleep(self, level: int) -> dict[str, int | None]:
        """Free the device memory of the weights (kept in host memory at level 1), the KV pool and the graphs: the
        bytes freed (`freed`) and the device's free memory before and after (`free_before`, `free_after`)."""
        free_before = device_free_bytes(self.device)
        self.release_graphs()
        freed = self.sleep_state.sleep(level, list(named_tensors(self.model, derived=True).values()), [self.kv_cache])
        free_cached_memory(self.device)
        return {"freed": freed, "free_before": free_before, "free_after": device_free_bytes(self.device)}

    def wake_up(self, tags: list[str] | None = None) -> tuple[list[str], dict[str, float]]:
        """Take back the memory of `tags`; once all is back, recapture the graphs (their addresses changed)."""
        woken = self.sleep_state.wake(tags)
        recapture: dict[str, float] = {}
        if woken and not self.sleep_state.sleeping:
            try:
                recapture = {kind: sum(secs.values()) for kind, secs in self.capture_graphs(strict=False).items()}
            except Exception as exc:  # the released graphs stay released: steps run eagerly, correctly
                print(f"warning: recapturing the CUDA graphs after waking failed ({type(exc).__name__}: {exc}); "
                      "serving eagerly", file=sys.stderr, flush=True)
        return woken, recapture

    def offer_weights(self, listener: handover.Listener, loaded: bool) -> str:
        """As the server stops for a restart: the KV pool and the graphs freed, every parameter and persistent buffer
        offered to the standby (`handover`); what happened, in words. Not where the weights were updated in place,
        slept away (`loaded` False) or sleep freed them."""
        if not listener.restarting:
            listener.close()
            return "not a restart"
        if self.weights.fingerprint is None or not loaded or self.sleep_state.sleeping:
            listener.close()
            return "weights not offered (updated in place or asleep since they were read)"
        self.release_graphs()
        self.decode_graphs = self.prefill_graphs = None
        for storage in unique_storages([self.kv_cache]):
            storage.resize_(0)
        free_cached_memory(self.device)
        return listener.offer(named_tensors(self.model), self.weights.fingerprint)

    def begin_update(self, model_dir: Path) -> int:
        """A weight update's begin (`prepare_update`): raises before touching anything if the checkpoint does not
        fit; returns how many tensors were viewed back to their checkpoint layout."""
        self.weights.fingerprint = None  # the values are the update's now, not the checkpoint's a restart reads
        return self.weights.prepare_update(model_dir)

    def load_update(self, model_dir: Path, mode: str) -> tuple[LoadReport, float]:
        """A weight update's load and finish, in place; `full` releases the graphs first and recaptures them after.
        The load report and the recapture's seconds."""
        if mode == "full":
            self.release_graphs()
            self._graphs_released = True
        report = self.weights.load(model_dir, self.config.load_format, self.config.load_memory_limit)
        recapture = 0.0
        if self._graphs_released:  # this full update's, or a failed full update's before it
            recapture = sum(sum(secs.values()) for secs in self.capture_graphs(strict=False).values())
            self._graphs_released = False
        return report, recapture

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> Sampled:
        params = [s.params for s in seqs]
        extras = self.extras(seqs) if any(p.extras for p in params) else None
        return self.sampler(logits, [p.temperature for p in params], [p.top_k for p in params],
                            [p.top_p for p in params], [self._seed(s) for s in seqs], extras, self.sampler_state)

    def extras(self, seqs: list[Sequence]) -> Extras:
        """The rows' logprobs, slots and min_tokens for the sampler; a request's first draw with penalties or a
        bias starts its slot (its prompt, its penalty values, its bias)."""
        params = [s.params for s in seqs]
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        slots = None
        if any(p.needs_state for p in params):
            for seq in seqs:
                if seq.init_slot:
                    p = seq.params
                    self.sampler_state.start(seq.sampler_slot, seq.history, seq.num_prompt_tokens, p.presence_penalty,
                                             p.frequency_penalty, p.repetition_penalty, p.logit_bias)
            slots = [-1 if s.sampler_slot is None else s.sampler_slot for s in seqs]
        suppress = [(i, t) for i, s in enumerate(seqs) if s.num_output_tokens < s.params.min_tokens
                    for t in (*self.eos_token_ids, *s.params.stop_token_ids)]
        return Extras(logprob_rows, max((params[i].logprobs for i in logprob_rows), default=0), slots, suppress)

    def _seed(self, seq: Sequence) -> int:
        """This step's noise seed: from the request's seed and its token count (reproducible), else random."""
        if seq.params.seed is None:
            return self.rng.getrandbits(63)
        return hash((seq.params.seed, seq.num_output_tokens)) & (2**63 - 1)

"""Owns the model, the KV pool and the sampler; turns a scheduled batch into sampled tokens."""
import torch

from runtime.config import EngineConfig, ModelConfig
from runtime.context import Context, set_context
from runtime.engine.scheduler import ScheduledBatch
from runtime.engine.sequence import Sequence
from runtime.layers.attention import Attention
from runtime.models import MODELS
from runtime.sampling.sampler import Sampler
from runtime.weights.loader import load_weights

CPU_KV_BYTES = 512 << 20


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_dir, max_model_len: int):
        self.config, self.model_config = config, model_config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype(model_config)
        torch.manual_seed(config.seed)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with self.device:
                self.model = MODELS[model_config.architecture](model_config)
        finally:
            torch.set_default_dtype(default_dtype)
        load_weights(self.model, model_dir)
        self.model.eval()
        self.sampler = Sampler()
        self.kv_cache = self._allocate_kv_cache(max_model_len)
        self.generators: dict[int, torch.Generator] = {}

    @property
    def num_pages(self) -> int:
        return self.kv_cache.shape[2]

    def _allocate_kv_cache(self, max_model_len: int) -> torch.Tensor:
        c, page = self.model_config, self.config.page_size
        page_bytes = 2 * c.num_hidden_layers * page * c.num_key_value_heads * c.head_dim * self.dtype.itemsize
        num_pages = self.config.kv_pages
        if num_pages is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                total = torch.cuda.get_device_properties(self.device).total_memory
                budget = free - (1 - self.config.gpu_memory_utilization) * total - (1 << 30)  # 1 GiB for activations
            else:
                budget = CPU_KV_BYTES
            num_pages = min(int(budget // page_bytes), self.config.max_running * -(-max_model_len // page))
        if num_pages * page < max_model_len:
            raise ValueError(
                f"the KV pool ({num_pages} pages of {page} tokens) cannot hold one sequence of max_model_len "
                f"{max_model_len}: raise --kv-pages or lower --max-model-len"
            )
        kv = torch.zeros(c.num_hidden_layers, 2, num_pages, page, c.num_key_value_heads, c.head_dim,
                         dtype=self.dtype, device=self.device)
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for layer, layer_kv in zip(layers, kv):
            layer.k_cache, layer.v_cache = layer_kv[0], layer_kv[1]
        return kv

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Flatten the batch into input ids and positions and set the step context."""
        page = self.config.page_size
        input_ids, positions, slots, cu, seq_lens, logits_indices = [], [], [], [0], [], []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += [seq.pages[p // page] * page + p % page for p in range(start, end)]
            cu.append(cu[-1] + n)
            seq_lens.append(end)
            if batch.samples(i):
                logits_indices.append(cu[-1] - 1)
        max_pages = max(len(s.pages) for s in batch.seqs)
        table = [s.pages + [0] * (max_pages - len(s.pages)) for s in batch.seqs]

        def tensor(values, dtype=torch.int32):
            return torch.tensor(values, dtype=dtype, pin_memory=self.device.type == "cuda").to(self.device, non_blocking=True)

        set_context(Context(
            cu_seqlens_q=tensor(cu), seq_lens=tensor(seq_lens), page_table=tensor(table),
            slot_mapping=tensor(slots, torch.int64), logits_indices=tensor(logits_indices, torch.int64),
            max_q_len=max(batch.num_tokens), max_seq_len=max(seq_lens),
        ))
        return tensor(input_ids, torch.int64), tensor(positions, torch.int64)

    @torch.inference_mode()
    def compute_logits(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits [S, V] (float32) of the rows this batch samples from."""
        input_ids, positions = self.prepare(batch)
        try:
            return self.model.compute_logits(self.model(input_ids, positions))
        finally:
            set_context(None)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[int]:
        """One forward + sampling; returns the sampled token of each sequence that samples, in order."""
        logits = self.compute_logits(batch)
        sampling = [s for i, s in enumerate(batch.seqs) if batch.samples(i)]
        if not sampling:
            return []
        return self.sample(logits, sampling).tolist()

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        params = [s.params for s in seqs]
        temperatures = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=self.device)
        top_ks = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=self.device)
        top_ps = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=self.device)
        return self.sampler(logits, temperatures, top_ks, top_ps, [self._generator(s) for s in seqs])

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        if seq.params.seed is None or seq.params.temperature == 0:
            return None
        if seq.seq_no not in self.generators:
            self.generators[seq.seq_no] = torch.Generator(self.device).manual_seed(seq.params.seed)
        return self.generators[seq.seq_no]

    def release(self, seq: Sequence) -> None:
        self.generators.pop(seq.seq_no, None)

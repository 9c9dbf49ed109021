"""Configuration: the model's (read from a Hugging Face config.json) and the engine's."""
import json
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Collection
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEFAULT_CAPTURE_SIZES = [1, 2, 4, 8] + list(range(16, 257, 8))
LOAD_FORMATS = ("auto", "pinned", "plain")  # --load-format; runtime/tsdev_runtime/weights/loader.py says what each does
# Where `tsdev serve` and tsdev's clients read the API key when --api-key is not given, the first set first
# (VLLM_API_KEY: vLLM's, so a vLLM deployment's environment keeps its server closed). docs/security.md.
API_KEY_ENV_VARS = ("TSDEV_API_KEY", "VLLM_API_KEY")
QUANTIZATIONS = ("fp8",)  # --quantization; runtime/tsdev_runtime/layers/linear.py
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # --kv-cache-dtype (vLLM's names): auto is the model's dtype
KERNEL_CHECK_MODES = ("report", "strict", "off")  # --kernel-check; runtime/tsdev_runtime/engine/kernel_checks.py


FP8_BLOCK = (128, 128)  # the only weight_block_size of a pre-quantized FP8 checkpoint tsdev loads


def stored_fp8_blocks(raw: dict) -> tuple[int, int] | None:
    """The (block_n, block_k) of a checkpoint stored as block-quantized FP8 (Qwen's *-FP8 releases, DeepSeek-V3),
    None for a high-precision one; ValueError, saying what to serve instead, for a stored format tsdev cannot load."""
    quantization = raw.get("quantization_config")
    if not quantization:
        return None
    method = quantization.get("quant_method", "?")
    if method != "fp8":
        raise ValueError(f"the weights are stored quantized (quantization_config: quant_method {method}), which "
                         "tsdev cannot load: serve the model's unquantized (bf16 or float32) checkpoint")
    blocks = quantization.get("weight_block_size")
    if blocks is None or tuple(blocks) != FP8_BLOCK or quantization.get("activation_scheme", "dynamic") != "dynamic":
        stored = f"one scale per {blocks[0]} x {blocks[1]} block" if blocks else "per-tensor or per-channel scales"
        raise ValueError(f"the weights are stored as FP8 with {stored} and {quantization.get('activation_scheme')} "
                         f"activations (quantization_config), which tsdev cannot load: it loads FP8 checkpoints with "
                         f"weight_block_size {list(FP8_BLOCK)} and dynamic activations; serve the model's bf16 "
                         "checkpoint, with --quantization fp8 for FP8 projections quantized at load")
    return FP8_BLOCK


@dataclass(frozen=True)
class ModelConfig:
    """What every served family has (the engine sizes its KV pool and graphs from it); `raw` is the whole
    config.json, where a model file reads its own fields (rope scaling, biases: runtime/tsdev_runtime/models/)."""
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    torch_dtype: str = "bfloat16"
    eos_token_ids: tuple[int, ...] = ()
    fp8_blocks: tuple[int, int] | None = None  # (block_n, block_k) of weights stored as block-quantized FP8
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dir(cls, model_dir: Path, served: "Collection[str]" = ()) -> "ModelConfig":
        """`served`: the architectures it may be (`tsdev_runtime.models.MODELS`); empty: the first one listed."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} has no config.json: pass a Hugging Face checkpoint directory")
        raw = json.loads(path.read_text())
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in served), None) if served else next(iter(archs), None)
        if arch is None:
            raise ValueError(f"{path}: architectures {archs} not supported; tsdev serves {', '.join(served)}")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads", "rms_norm_eps") if k not in raw]
        if missing:
            raise ValueError(f"{path} lacks {', '.join(missing)}")
        try:
            fp8_blocks = stored_fp8_blocks(raw)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        eos = _read_eos(Path(model_dir), raw)
        return cls(
            architecture=arch,
            fp8_blocks=fp8_blocks,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw.get("num_key_value_heads", raw["num_attention_heads"]),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
            rms_norm_eps=raw["rms_norm_eps"],
            max_position_embeddings=raw.get("max_position_embeddings", 32768),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype") or "bfloat16",
            eos_token_ids=eos,
            raw=raw,
        )


def _read_eos(model_dir: Path, raw: dict) -> tuple[int, ...]:
    gen = model_dir / "generation_config.json"
    value = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
    if value is None:
        value = raw.get("eos_token_id")
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


@dataclass
class EngineConfig:
    """What `tsdev serve` flags set. Rank and world size are here from the start for tensor parallelism."""

    model: str
    tokenizer: str | None = None  # a directory with tokenizer.json (and the chat template); default: the model's
    device: str = "cpu"
    dtype: str = "auto"  # auto: the checkpoint's dtype on CUDA, float32 on CPU
    max_running: int = 64
    max_batched_tokens: int = 2048  # per-step token budget; longer prompts are prefilled in chunks
    max_model_len: int | None = None  # default: the checkpoint's max_position_embeddings, capped at 8192
    page_size: int = 16
    # default: the memory budget (CUDA: free memory; CPU: 512 MiB), at most max_running full contexts
    kv_pages: int | None = None
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    enable_prefix_caching: bool = True
    rank: int = 0
    world_size: int = 1
    rank_timeout_s: float = 60.0  # how long rank 0 waits for another rank's outcome before it stops the server
    cudagraph_capture_sizes: list[int] = field(default_factory=lambda: list(DEFAULT_CAPTURE_SIZES))
    enforce_eager: bool = False  # no CUDA graphs
    async_scheduling: bool = True  # prepare step N+1 while the GPU computes step N
    full_recapture: bool = False  # a reload captures every graph again before serving resumes (else it patches
    #                               them after a kernel-body edit, or captures the used ones)
    prefill_graph_max_tokens: int = 2048  # largest prefill graph bucket (clamped to max_batched_tokens and the
    # context length); 0: off
    prefill_graph_capture_sizes: list[int] | None = None  # explicit buckets instead of the ladder
    # Capture only these before serving, the other sizes and buckets between steps after (a restart by tsdev watch:
    # what the server it replaces had used); None: all before serving.
    cudagraph_capture_first: list[int] | None = None
    prefill_graph_capture_first: list[int] | None = None
    load_format: str = "auto"  # pinned: staged through a page-locked buffer; plain: safetensors; auto: pinned on CUDA
    load_memory_limit: int = 16 << 30  # bytes of host memory the pinned staging buffer may take
    quantization: str | None = None  # "fp8": e4m3 projections with per-channel scales derived at load (docs/runtime.md)
    kv_cache_dtype: str = "auto"  # fp8 / fp8_e4m3: the KV pool in e4m3, one scale per tensor (docs/runtime.md)
    # a reload checks the kernels it changed against their references (runtime/tsdev_runtime/engine/kernel_checks.py):
    # report, strict (a failure rolls the reload back) or off
    kernel_check: str = "report"

    def torch_dtype(self, model_config: ModelConfig) -> "torch.dtype":
        import torch  # here, so that the CLI and clients read the defaults without loading torch

        name = self.dtype
        if name == "auto":
            name = model_config.torch_dtype if self.device.startswith("cuda") else "float32"
        try:
            return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]
        except KeyError:
            raise ValueError(f"dtype {name!r} not supported: use auto, bfloat16, float16 or float32") from None

    def tokenizer_dir(self, model_dir: Path) -> Path:
        """Where the tokenizer (and the chat template) are: --tokenizer, else the model's directory."""
        return Path(self.tokenizer) if self.tokenizer else model_dir

    def kv_torch_dtype(self, model_dtype: "torch.dtype") -> "torch.dtype":
        """The KV pool's dtype: the model's (auto), or e4m3 (fp8, fp8_e4m3)."""
        import torch

        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r}: use one of {', '.join(KV_CACHE_DTYPES)}")
        return model_dtype if self.kv_cache_dtype == "auto" else torch.float8_e4m3fn


_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from "17179869184", "16GB" (10**9), "16GiB" (2**30), "512 MiB", "1.5g"."""
    number = text.strip().rstrip("bBiIkKmMgGtT ")
    unit = text.strip()[len(number):].strip().lower()
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _SIZE_UNITS or not 0 <= value * _SIZE_UNITS.get(unit, 1) < 2**63:
        raise ValueError(f"{text!r} is not a size: give bytes, or a number with a unit such as 16GB or 512MiB")
    return int(value * _SIZE_UNITS[unit])


@dataclass
class ServerConfig:
    """What `tsdev serve` flags set for the HTTP front (the engine's are EngineConfig's)."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (the listening line says which)
    served_model_name: str | None = None  # default: the hub id, else the checkpoint directory's name
    # a jinja2 file; default: the checkpoint's own (runtime/tsdev_runtime/server/chat.py)
    chat_template: str | None = None
    allow_reload_forward: bool = False
    # processes compiling an edit's kernels side by side (tsdev/hotreload/pool.py); 0: none; None: the default
    compile_workers: int | None = None
    log_level: str = "warning"  # uvicorn's
    # the HTTP front (tokenizing, detokenizing, JSON, SSE) in a process of its own beside the engine's step loop
    # (runtime/tsdev_runtime/server/api_process.py); False: both in one process
    api_process: bool = True
    max_request_body_bytes: int = 4 * 1024 * 1024  # larger bodies are answered 413 before they are parsed
    # Who may call what (runtime/tsdev_runtime/server/security.py, docs/security.md):
    api_key: str | None = field(default=None, repr=False)  # every route but /health and /metrics needs it
    allow_remote_control: bool = False  # control routes answer any client, not only loopback ones
    metrics_require_api_key: bool = False  # /metrics needs the key too
    profile_dir: str = "profiles"  # /start_profile writes only under it
    allowed_weight_dirs: list[str] = field(default_factory=list)  # weight paths beside the model's directory

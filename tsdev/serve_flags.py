"""What each `tsdev serve` flag may be, checked before torch imports and before anything binds or loads: `tsdev serve`
and the server `tsdev watch` starts refuse a bad value with one line naming the flag and what it takes (exit status
2), not a traceback from deep in the engine's warm-up. The engine's own checks that need the checkpoint (a
--max-model-len over the model's context, a KV pool too small for one sequence) stay in the engine."""
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tsdev_runtime.config import KERNEL_CHECK_MODES, KV_CACHE_DTYPES, LOAD_FORMATS, QUANTIZATIONS, parse_size

DTYPES = ("auto", "bfloat16", "float16", "float32")  # EngineConfig.torch_dtype's
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's (any case)
DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")

# Integer flags: parameter name -> (least, most or None, what the user may want to know on the way).
INTEGER_RANGES: dict[str, tuple[int, int | None, str]] = {
    "port": (0, 65535, "0 takes any free port"),
    "max_running": (1, None, ""),
    "max_batched_tokens": (1, None, ""),
    "kv_pages": (1, None, "leave it out to size the pool from the free memory"),
    "page_size": (1, None, ""),
    # the warm-up runs a prompt of max_model_len - 1 tokens and samples one more
    "max_model_len": (2, None, "leave it out for the model's own, capped at 8192"),
    "prefill_graph_max_tokens": (0, None, "0 turns prefill graphs off"),
    "compile_workers": (0, None, "0: none"),
    "tp": (1, None, ""),
    "dp": (1, None, ""),
    "max_request_body_bytes": (1, None, ""),
    "seed": (0, 2**64 - 1, ""),  # torch.manual_seed's range
}
CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": DTYPES, "load_format": LOAD_FORMATS, "quantization": QUANTIZATIONS, "kv_cache_dtype": KV_CACHE_DTYPES,
    "kernel_check": KERNEL_CHECK_MODES,
}
SIZE_LISTS = ("cudagraph_capture_sizes", "prefill_graph_capture_sizes", "cudagraph_capture_first",
              "prefill_graph_capture_first")


def flag_name(command: Any, name: str) -> str:
    """How the user may spell parameter `name`: `--max-running / --max-num-seqs`."""
    param = next(p for p in command.params if p.name == name)
    return " / ".join(param.opts) if param.opts[0].startswith("-") else name.upper()


def sizes_problem(value: str) -> str | None:
    """What is wrong with a list flag's value ("1,16,64", "1 16 64"), or None."""
    parts = [v for v in re.split(r"[,\s]+", value) if v]
    if parts and all(p.isdigit() and int(p) >= 1 for p in parts):
        return None
    return "give positive integers"


def problem(command: Any, params: Mapping) -> str | None:
    """The first thing wrong with `tsdev serve`'s parsed `params` (click's, by parameter name), as one line that
    names the flag, what it takes and what was given; None when every flag is fine."""
    def flag(name: str) -> str:
        return flag_name(command, name)

    for name, (least, most, note) in INTEGER_RANGES.items():
        value = params.get(name)
        if value is not None and not least <= value <= (most if most is not None else value):
            allowed = f"from {least} to {most}" if most is not None else f"at least {least}"
            return f"{flag(name)} must be {allowed} (got {value})" + (f"; {note}" if note else "")
    utilization = params.get("gpu_memory_utilization")
    if utilization is not None and not 0 < utilization <= 1:
        return (f"{flag('gpu_memory_utilization')} must be more than 0 and at most 1, a fraction of the GPU's memory "
                f"(got {utilization})")
    timeout = params.get("rank_timeout")
    if timeout is not None and not (math.isfinite(timeout) and timeout >= 1):
        return f"{flag('rank_timeout')} must be a number of seconds, at least 1 (got {timeout})"
    for name, choices in CHOICES.items():
        if (value := params.get(name)) is not None and value not in choices:
            return f"{flag(name)} must be one of {', '.join(choices)} (got {value})"
    if (level := params.get("log_level")) is not None and level.lower() not in LOG_LEVELS:
        return f"{flag('log_level')} must be one of {', '.join(LOG_LEVELS)} (got {level})"
    if (device := params.get("device")) is not None and not DEVICE.match(device):
        return f"{flag('device')} must be cpu, cuda or cuda:N (got {device})"
    for name in SIZE_LISTS:
        if (value := params.get(name)) is not None and (why := sizes_problem(value)):
            option = flag(name).split(" / ")[0]
            return f"{option}: {why}, e.g. {option} 1 16 64 (got {value!r})"
    try:
        if params.get("load_memory_limit") is not None:
            parse_size(params["load_memory_limit"])
    except ValueError as exc:
        return f"{flag('load_memory_limit')}: {exc}"
    return relations_problem(command, params)


def relations_problem(command: Any, params: Mapping) -> str | None:
    """Flags that are each fine but do not go together."""
    def flag(name: str) -> str:
        return flag_name(command, name).split(" / ")[0]

    model, model_opt = params.get("model"), params.get("model_opt")
    if model and model_opt and model != model_opt:
        return f"MODEL {model!r} and {flag('model_opt')} {model_opt!r} disagree: give one"
    if params.get("revision") is not None and not (model or model_opt):
        return f"{flag('revision')} needs a hub id (ORG/NAME) to apply to"
    template = params.get("chat_template")
    if template is not None and not Path(template).is_file():
        return f"{flag('chat_template')} {template}: no such file (give a jinja2 template file)"
    reloads = params.get("allow_reload_forward")
    if params.get("kernel_check") is not None and not reloads:
        return (f"{flag('kernel_check')}: kernel checks run on reloads: add --allow-reload-forward "
                "(tsdev watch does)")
    if params.get("compile_workers") and not reloads:
        return (f"{flag('compile_workers')}: compile workers serve reloads: add --allow-reload-forward "
                "(tsdev watch does)")
    kv_pages, page_size, max_model_len = params.get("kv_pages"), params.get("page_size"), params.get("max_model_len")
    if kv_pages and page_size and max_model_len and kv_pages * page_size < max_model_len:
        return (f"{flag('kv_pages')} {kv_pages} of {flag('page_size')} {page_size} hold {kv_pages * page_size} "
                f"tokens, fewer than one sequence of {flag('max_model_len')} {max_model_len}: raise --kv-pages or "
                "lower --max-model-len")
    return None

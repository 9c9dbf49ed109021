"""Chat prompts: the tokenizer's Jinja chat template when the checkpoint has one, ChatML otherwise."""
import json
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment

from runtime.weights.default_model import CHATML



class ChatTemplate:
    def __init__(self, model_dir: Path):
        config_file = Path(model_dir) / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        source = config.get("chat_template") or CHATML
        if isinstance(source, list):  # named templates: use "default"
            source = next((t["template"] for t in source if t.get("name") == "default"), source[0]["template"])
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
        self.template = env.from_string(source)
        self.special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token")}

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.special)


def _token_text(value) -> str:
    return value.get("content", "") if isinstance(value, dict) else (value or "")


def _raise(message: str):
    raise ValueError(message)

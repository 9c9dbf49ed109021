"""Chat prompts from the checkpoint's own template, rendered the way transformers renders it
(`apply_chat_template`: a sandboxed jinja2 environment with trim_blocks / lstrip_blocks, loop controls,
`raise_exception`, `strftime_now`, `tojson`, and the tokenizer's special tokens as variables).

Where the template comes from, first found: `--chat-template FILE`; the checkpoint's `chat_template.jinja`
(what transformers writes since 4.43); `chat_template` in its `tokenizer_config.json` (a string, or named
templates: "default"); else ChatML (the embedded default model's).
"""
import json
from datetime import datetime
from pathlib import Path

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tsdev_runtime.engine.sequence import InvalidRequest
from tsdev_runtime.weights.chatml import CHATML

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplate:
    def __init__(self, model_dir: Path, template_file: Path | None = None):
        config_file = Path(model_dir) / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.source, self.origin = template_source(Path(model_dir), config, template_file)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        self.template = env.from_string(self.source)
        self.special = {k: _token_text(config.get(k)) for k in SPECIAL_TOKENS}

    def render(self, messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False,
               variables: dict | None = None) -> str:
        """The prompt text. `continue_final_message`: cut after the final message's text (its end-of-turn marker
        dropped), so that the reply continues it. `variables`: more for the template (chat_template_kwargs);
        InvalidRequest for one that would replace what this renders with."""
        clash = sorted(set(variables or ()) & {"messages", "add_generation_prompt", *self.special})
        if clash:
            raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(clash)} (the server sets them)",
                                 "chat_template_kwargs")
        text = self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                    **self.special, **(variables or {}))
        if continue_final_message:
            final = messages[-1]["content"]
            end = text.rfind(final) if final else -1
            if end < 0:
                raise InvalidRequest("continue_final_message: the template does not write the final message's text "
                                     "as sent (it changes it), so it cannot be continued", "continue_final_message")
            text = text[: end + len(final)]
        return text


def template_source(model_dir: Path, config: dict, template_file: Path | None) -> tuple[str, str]:
    """(the template's text, where it came from)."""
    if template_file is not None:
        if not Path(template_file).is_file():
            raise FileNotFoundError(f"--chat-template {template_file}: no such file (give a jinja2 template file)")
        return Path(template_file).read_text(), str(template_file)
    if (jinja := model_dir / "chat_template.jinja").is_file():
        return jinja.read_text(), str(jinja)
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: use "default"
        source = next((t["template"] for t in source if t.get("name") == "default"), source[0]["template"])
    if source:
        return source, f"{model_dir / 'tokenizer_config.json'} (chat_template)"
    return CHATML, "ChatML (the checkpoint has no chat template)"


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _token_text(value) -> str:
    return value.get("content", "") if isinstance(value, dict) else (value or "")


def _raise(message: str):
    raise ValueError(message)

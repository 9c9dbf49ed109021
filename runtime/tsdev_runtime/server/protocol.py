"""OpenAI request bodies, validated by pydantic, with vLLM's extensions (`ignore_eos`, `repetition_penalty`,
`min_tokens`, `stop_token_ids`, ...). Nothing is accepted and ignored: an unknown field is a 400 naming it
(`extra="forbid"`), and the OpenAI fields this server does not implement are declared only to refuse them
with what to do instead (a no-op value, such as `response_format: {"type": "text"}`, passes). Nor is anything
coerced: JSON types are taken as sent (`strict=True`), so `"max_tokens": "3"`, `"max_tokens": true` or
`"stream": "yes"` is a 400 naming the field and its type (a JSON integer still passes for a number field)."""
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tsdev_runtime.control_protocol import Text
from tsdev_runtime.engine.sequence import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams

MAX_N = 16  # choices per prompt


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: the usage so far in every chunk


def refuse_unless(value: Any, harmless: tuple, message: str) -> Any:
    """A field this server does not implement passes only with a value that asks for nothing."""
    if value not in harmless:
        raise ValueError(message)
    return value


GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
          "guided_whitespace_pattern", "structured_outputs")
# Declared only to be refused with a reason (their no-op values pass): not what a route "reads".
REFUSED = {*GUIDED, "response_format", "prompt_logprobs", "suffix", "best_of", "tools", "tool_choice",
           "parallel_tool_calls", "functions", "function_call"}


def supported_fields(model: type[BaseModel]) -> list[str]:
    return sorted(set(model.model_fields) - REFUSED)


class SamplingRequest(Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1, le=2**31 - 1)  # 0 or -1: off; beyond int64 it broke the engine's step (issue 19)
    seed: int | None = Field(None, ge=-2**63, lt=2**63)
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, gt=0, le=2, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False  # vLLM extension: each choice also carries the generated token ids
    # declared to be refused with a reason (a value that asks for nothing passes)
    response_format: dict | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    structured_outputs: Any = None
    prompt_logprobs: Any = None
    user: str | None = Field(None, max_length=256)  # an end-user id: written in the request's log line

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for token, value in (bias or {}).items():
            if not token.lstrip("-").isdigit():
                raise ValueError(f"keys are token ids (strings of integers, as OpenAI's), got {token!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"values must be in [-100, 100] (OpenAI's range), got {value} for token {token}")
        return bias

    @field_validator("response_format")
    @classmethod
    def _format(cls, value: dict | None) -> dict | None:
        return refuse_unless(value, (None, {"type": "text"}), "structured output (json_object, json_schema) is "
                             "not supported: ask for JSON in the prompt and parse the text ({\"type\": \"text\"} "
                             "is accepted)")

    @field_validator(*GUIDED)
    @classmethod
    def _guided(cls, value: Any, info) -> Any:
        return refuse_unless(value, (None,), f"guided decoding ({info.field_name}) is not supported by this server: "
                             "constrain the output in the prompt and check the text")

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs(cls, value: Any) -> Any:
        return refuse_unless(value, (None,), "vLLM's prompt_logprobs output is not implemented: send "
                             "/v1/completions with \"echo\": true and \"logprobs\": N (the prompt's tokens and "
                             "logprobs)")

    @field_validator("stream_options")
    @classmethod
    def _streamed(cls, options: StreamOptions | None, info) -> StreamOptions | None:
        if options is not None and info.data.get("stream") is False:  # (absent: stream itself was refused)
            raise ValueError("stream_options says what a stream carries: send it with \"stream\": true, or drop it")
        return options

    @model_validator(mode="after")
    def _consistent(self):
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        return self

    def sampling_params(self, max_tokens: int, seed_offset: int = 0, logprobs: int | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's parameters; choice i of n draws with seed + i (reproducible and distinct)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        seed = None if self.seed is None else (self.seed + seed_offset + 2**63) % 2**64 - 2**63
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=seed,
            stop=[s for s in stop if s], ignore_eos=self.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()}, min_tokens=self.min_tokens,
            stop_token_ids=list(self.stop_token_ids or []), include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(SamplingRequest):
    prompt: Text | list[int] | list[Text] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # top-N per token (0: the drawn token's only)
    best_of: int | None = None
    suffix: Text | None = None

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, value: str | None) -> str | None:
        return refuse_unless(value, (None, ""), "suffix (insertion) is not supported: send the text before the "
                             "insertion point as the prompt")

    @model_validator(mode="after")
    def _best_of(self):
        refuse_unless(self.best_of, (None, self.n), f"best_of > n is not supported (best_of={self.best_of}, "
                      f"n={self.n}): ask for n={self.best_of} with logprobs and rank the choices yourself")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 generates nothing: to score a prompt send \"echo\": true with "
                             "\"logprobs\": N; otherwise ask for at least 1 token")
        return self


class ContentPart(Strict):
    type: str = "text"
    text: Text = ""

    @field_validator("type")
    @classmethod
    def _text_only(cls, kind: str) -> str:
        return refuse_unless(kind, ("text",), f"content parts of type {kind!r} are not supported: this server "
                             "serves a text model; send {\"type\": \"text\", \"text\": ...} parts or a string")


ROLES = ("system", "user", "assistant", "tool", "developer")


class ChatMessage(Strict):
    role: str = Field(json_schema_extra={"enum": list(ROLES)})  # checked below, with a message that lists them
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    # what an OpenAI reply's message carries, when a client sends it back as history: refused unless empty
    tool_calls: list | None = None
    tool_call_id: Text | None = None
    function_call: Any = None
    refusal: Text | None = None
    annotations: list | None = None
    audio: Any = None

    @field_validator("tool_calls", "tool_call_id", "function_call", "refusal", "annotations", "audio")
    @classmethod
    def _history_fields(cls, value: Any, info) -> Any:
        return refuse_unless(value, (None, []), f"messages with {info.field_name} are not supported: this server "
                             "has no tool calling or audio; send the message's text as content")

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}: use one of {', '.join(ROLES)}")
        return role

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        """The message as a chat template reads it; OpenAI's "developer" role is a system prompt here."""
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        return message if self.name is None else {**message, "name": self.name}


class ChatTemplateFields(Strict):
    """How the messages are rendered (vLLM's): `add_generation_prompt` opens the assistant's turn,
    `continue_final_message` leaves the final message open instead (the reply continues it), and
    `chat_template_kwargs` are more variables for the template (Qwen3's `enable_thinking`)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_way_to_end(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message continues the final message instead of opening a new turn: "
                             "send it with \"add_generation_prompt\": false")
        return self


class ChatCompletionRequest(ChatTemplateFields, SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    echo: bool = False  # the reply starts with the final message's text when that message is the assistant's
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list | None = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: list | None = None
    function_call: Any = None

    @field_validator("tools", "functions")
    @classmethod
    def _tools(cls, value: list | None, info) -> list | None:
        return refuse_unless(value, (None, []), f"tool calling ({info.field_name}) is not supported by this server: "
                             "describe the tools in the prompt and parse the reply")

    @field_validator("tool_choice", "parallel_tool_calls", "function_call")
    @classmethod
    def _tool_choice(cls, value: Any, info) -> Any:
        return refuse_unless(value, (None, "none", False), f"tool calling ({info.field_name}) is not supported by "
                             "this server: describe the tools in the prompt and parse the reply")

    @model_validator(mode="after")
    def _top_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs \"logprobs\": true")
        if self.max_tokens == 0:
            raise ValueError("max_tokens must be at least 1 for chat completions")
        return self


class TokenizeRequest(ChatTemplateFields, Strict):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""
    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (vLLM's)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of \"prompt\" (text) or \"messages\" (chat messages)")
        return self


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]

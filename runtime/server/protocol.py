"""OpenAI request bodies, validated by pydantic. Unknown fields are ignored, as OpenAI servers do."""
from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from runtime.control_protocol import Text
from runtime.engine.sequence import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1, le=2**31 - 1)  # 0 or -1: off; beyond int64 it broke the engine's step (issue 19)
    seed: int | None = None
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=1, description="only n=1 is supported")
    logprobs: bool | int | None = None
    return_token_ids: bool = False  # vLLM extension: each choice also carries the generated token ids

    @model_validator(mode="after")
    def _supported(self):
        if self.logprobs not in (None, False):
            raise ValueError("logprobs are not supported by this server")
        return self

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, seed=self.seed, stop=[s for s in stop if s],
                              ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    prompt: Text | list[int] | list[Text] | list[list[int]]
    echo: Literal[False] = False


class ContentPart(BaseModel):
    type: str = "text"
    text: Text = ""


ROLES = ("system", "user", "assistant", "tool", "developer")


class ChatMessage(BaseModel):
    role: str = Field(json_schema_extra={"enum": list(ROLES)})  # checked below, with a message that lists them
    content: Text | list[ContentPart] | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}: use one of {', '.join(ROLES)}")
        return role

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content if part.type == "text")
        return self.content or ""

    def for_template(self) -> dict:
        """The message as a chat template reads it; OpenAI's "developer" role is a system prompt here."""
        return {"role": "system" if self.role == "developer" else self.role, "content": self.text()}


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

"""What the OpenAI routes share, passed to their router explicitly: what generates (the engine beside them, or the
engine process's channel), what they read of the model, the served model's name, the tokenizer threads and the
checks every generating route makes before it queues a request."""
import asyncio
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from tokenizers import Tokenizer

from tsdev_runtime.engine.outputs import RequestOutput
from tsdev_runtime.engine.sequence import InvalidRequest, SamplingParams, check_prompt, check_sampling
from tsdev_runtime.server.chat import ChatTemplate
from tsdev_runtime.server.errors import APIError


class Generator(Protocol):
    """What the routes generate through: AsyncEngine, or the API process's EngineChannel."""

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 after: str | None = None) -> AsyncIterator[RequestOutput]: ...

    def unavailable(self) -> str | None: ...


@dataclass(frozen=True)
class ServedModel:
    """What the routes read of the model served: its tokenizer, where its chat template lies, its limits."""
    tokenizer: Tokenizer
    tokenizer_dir: Path
    max_model_len: int
    vocab_size: int

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        check_prompt(prompt_token_ids, self.max_model_len, self.vocab_size)

    def check_sampling(self, params: SamplingParams) -> None:
        check_sampling(params, self.vocab_size)


@dataclass
class ServerDeps:
    generator: Generator
    model: ServedModel
    served_model_name: str
    chat_template: ChatTemplate
    created: int = field(default_factory=lambda: int(time.time()))
    # Tokenizing (and chat templates) run here, neither on the event loop nor on the engine's thread.
    tokenizer_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(2, thread_name_prefix="tokenize"))

    def __post_init__(self):
        self.max_prompt_chars = prompt_char_limit(self.model)

    async def off_loop(self, fn: Callable):
        """Run `fn` (tokenizing, checking lengths) in the tokenizer threads: the event loop keeps serving."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, fn)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt; one so long that it cannot fit the context is refused without tokenizing it."""
        if len(text) > self.max_prompt_chars:
            raise APIError(400, f"this model's maximum context length is {self.model.max_model_len} tokens, but the "
                                f"prompt has {len(text)} characters, more than that many tokens can hold: shorten it",
                           "prompt")
        return self.model.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def check_length(self, prompt_ids: list[int], max_tokens: int | None) -> int:
        """Validate the prompt and return max_tokens (default: the rest of the context)."""
        try:
            self.model.check_prompt(prompt_ids)
        except InvalidRequest as exc:
            raise APIError(400, str(exc), exc.field) from None
        limit = self.model.max_model_len
        if max_tokens is None:
            max_tokens = limit - len(prompt_ids)
        if len(prompt_ids) + max_tokens > limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens, but {len(prompt_ids)} "
                                f"prompt tokens + {max_tokens} max_tokens were requested: shorten the prompt or "
                                "lower max_tokens", "max_tokens")
        return max_tokens

    def check_sampling(self, params: list[SamplingParams]) -> list[SamplingParams]:
        """400 for a value the engine would index the logits with outside the vocabulary (sequence.check_sampling)."""
        try:
            for p in params:
                self.model.check_sampling(p)
        except InvalidRequest as exc:
            raise APIError(400, str(exc), exc.field) from None
        return params

    def check_model(self, body) -> None:
        if body.model is not None and body.model != self.served_model_name:
            raise APIError(400, f"model {body.model!r} does not exist: this server serves {self.served_model_name!r} "
                                "(GET /v1/models)", "model")

    def check_available(self) -> None:
        """503 while the server sleeps (or has no weights loaded), saying what brings it back."""
        if why := self.generator.unavailable():
            raise APIError(503, why, None, "server_error")

    def render(self, body) -> str:
        """The prompt text of a chat request (its messages and how to end them: protocol.ChatTemplateFields)."""
        try:
            return self.chat_template.render([m.for_template() for m in body.messages], body.add_generation_prompt,
                                             body.continue_final_message, body.chat_template_kwargs)
        except InvalidRequest as exc:
            raise APIError(400, str(exc), exc.field) from None
        except Exception as exc:
            raise APIError(400, f"the chat template failed on these messages: {exc}", "messages") from exc

    def close(self) -> None:
        self.tokenizer_pool.shutdown(wait=False, cancel_futures=True)


def prompt_char_limit(model: ServedModel) -> int:
    """Characters beyond which a prompt surely has more tokens than the context holds: no token covers more
    characters than the longest vocabulary entry (halved again for normalisation that merges characters)."""
    longest = max(map(len, model.tokenizer.get_vocab(with_added_tokens=True)), default=1)
    return 2 * max(longest, 1) * model.max_model_len

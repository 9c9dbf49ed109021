"""What the routes share, passed to each router explicitly: the engine, the served model's name, the tokenizer
threads and the checks every generating route makes before it queues a request."""
import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tsdev_runtime.engine.async_engine import AsyncEngine
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.engine.sequence import InvalidRequest, SamplingParams
from tsdev_runtime.server.chat import ChatTemplate
from tsdev_runtime.server.errors import APIError


@dataclass
class ServerDeps:
    async_engine: AsyncEngine
    served_model_name: str
    chat_template: ChatTemplate
    created: int = field(default_factory=lambda: int(time.time()))
    # Tokenizing (and chat templates) run here, neither on the event loop nor on the engine's thread.
    tokenizer_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(2, thread_name_prefix="tokenize"))

    def __post_init__(self):
        self.max_prompt_chars = prompt_char_limit(self.engine)

    @property
    def engine(self) -> LLMEngine:
        return self.async_engine.engine

    async def off_loop(self, fn: Callable):
        """Run `fn` (tokenizing, checking lengths) in the tokenizer threads: the event loop keeps serving."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, fn)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt; one so long that it cannot fit the context is refused without tokenizing it."""
        if len(text) > self.max_prompt_chars:
            raise APIError(400, f"this model's maximum context length is {self.engine.max_model_len} tokens, but the "
                                f"prompt has {len(text)} characters, more than that many tokens can hold: shorten it",
                           "prompt")
        return self.engine.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def check_length(self, prompt_ids: list[int], max_tokens: int | None) -> int:
        """Validate the prompt and return max_tokens (default: the rest of the context)."""
        try:
            self.engine.check_prompt(prompt_ids)
        except InvalidRequest as exc:
            raise APIError(400, str(exc), exc.field) from None
        limit = self.engine.max_model_len
        if max_tokens is None:
            max_tokens = limit - len(prompt_ids)
        if len(prompt_ids) + max_tokens > limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens, but {len(prompt_ids)} "
                                f"prompt tokens + {max_tokens} max_tokens were requested: shorten the prompt or "
                                "lower max_tokens", "max_tokens")
        return max_tokens

    def check_sampling(self, params: list[SamplingParams]) -> list[SamplingParams]:
        """400 for a value the engine would index the logits with outside the vocabulary (LLMEngine.check_sampling)."""
        try:
            for p in params:
                self.engine.check_sampling(p)
        except InvalidRequest as exc:
            raise APIError(400, str(exc), exc.field) from None
        return params

    def check_model(self, body) -> None:
        if body.model is not None and body.model != self.served_model_name:
            raise APIError(400, f"model {body.model!r} does not exist: this server serves {self.served_model_name!r} "
                                "(GET /v1/models)", "model")

    def check_available(self) -> None:
        """503 while the server sleeps (or has no weights loaded), saying what brings it back."""
        if why := self.async_engine.unavailable():
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


def prompt_char_limit(engine: LLMEngine) -> int:
    """Characters beyond which a prompt surely has more tokens than the context holds: no token covers more
    characters than the longest vocabulary entry (halved again for normalisation that merges characters)."""
    longest = max(map(len, engine.tokenizer.get_vocab(with_added_tokens=True)), default=1)
    return 2 * max(longest, 1) * engine.max_model_len

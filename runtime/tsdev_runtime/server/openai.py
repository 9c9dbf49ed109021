"""The OpenAI routes (completions, chat completions) and vLLM's /tokenize and /detokenize, over an AsyncEngine.

A request with `n` choices per prompt is n engine requests: choice i draws with seed + i, and choices after the
first wait for the first to compute the prompt, then find its pages in the prefix cache. Each choice's outputs
go through one `Choice`, which turns them into the route's deltas (text, logprobs in the route's shape); a
non-streamed reply is the sum of those deltas.
"""
import asyncio
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from tsdev_runtime.engine.errors import EngineError, Unavailable
from tsdev_runtime.engine.outputs import RequestOutput
from tsdev_runtime.engine.sequence import TokenLogprob
from tsdev_runtime.server.deps import ServedModel, ServerDeps
from tsdev_runtime.server.errors import APIError, error_body
from tsdev_runtime.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, SamplingRequest,
                                     TokenizeRequest)
from tsdev_runtime.server.sse import sse_response

MIN_LOGPROB = -9999.0  # what JSON carries for a logprob of -inf (vLLM's)
requests_log = logging.getLogger("tsdev_runtime.requests")  # a line per request (tsdev serve --log-level info)


def log_request(request_id: str, body: SamplingRequest, prompt_tokens: int, max_tokens: int) -> None:
    if requests_log.isEnabledFor(logging.INFO):
        user = f" from user {body.user!r}" if body.user is not None else ""
        requests_log.info("%s%s: %d prompt token(s), max_tokens %d, n %d, temperature %g%s", request_id, user,
                          prompt_tokens, max_tokens, body.n, body.temperature, ", streamed" if body.stream else "")


class Choice:
    """One choice's outputs as the route's deltas. `echo`: (prompt text, prompt token ids) that lead the first
    delta (chat: the final message's text, no ids); `top_n`: logprobs asked for (None: none);
    `skip_special_tokens`: as the request decodes its text (completions' `text_offset` index that text)."""

    def __init__(self, index: int, model: ServedModel, chat: bool, top_n: int | None,
                 echo: tuple[str, list[int]] | None = None, skip_special_tokens: bool = True):
        self.index, self.model, self.chat, self.top_n, self.echo = index, model, chat, top_n, echo
        self.started = False
        self.offset = 0  # completions' text_offset of the next generated token
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)  # the engine's decoding, for offsets
        self.text, self.token_ids, self.logprobs, self.final = "", [], [], None

    def delta(self, out: RequestOutput) -> tuple[str, list | dict | None]:
        """(text, logprobs) of this output; the first carries the echoed prompt. Also accumulated (`add`)."""
        text, prompt, offsets = out.new_text, [], []
        if not self.started:
            self.started = True
            if self.echo is not None:
                prompt_text, prompt_ids = self.echo
                text, self.offset = prompt_text + text, len(prompt_text)
                if prompt_ids is not None and self.top_n is not None:  # (chat echoes text only)
                    prompt = [TokenLogprob(prompt_ids[0], None, None, None), *(out.prompt_logprobs or [])]
                    offsets = prompt_offsets(self.model.tokenizer, prompt_text, prompt_ids)
        if self.top_n is None:
            return text, None
        generated = out.logprobs or []
        if not self.chat:
            offsets += self.generated_offsets(generated)
        return text, self.format(prompt + generated, offsets)

    def add(self, out: RequestOutput, text: str, logprobs) -> None:
        self.text += text
        self.token_ids += out.new_token_ids
        if logprobs is not None:
            self.logprobs.append(logprobs)
        if out.finished:
            self.final = out

    def generated_offsets(self, entries: list[TokenLogprob]) -> list[int]:
        """Where each generated token's text starts in the choice's text: decoded as the engine decodes it, so a
        character split across tokens starts at the token that completes it, and the offsets add up to the text."""
        offsets = []
        for e in entries:
            offsets.append(self.offset)
            self.offset += len(self.stream.step(self.model.tokenizer, e.token_id) or "")
        return offsets

    def format(self, entries: list[TokenLogprob], offsets: list[int]) -> list | dict:
        tokenizer = self.model.tokenizer
        ids = [e.token_id for e in entries] + [t for e in entries for t in (e.top_ids or ())]
        strings = dict(zip(ids, tokenizer.decode_batch([[t] for t in ids], skip_special_tokens=False)))
        if self.chat:
            def entry(t: int, logprob: float) -> dict:
                return token_entry(strings[t], logprob, token_bytes(tokenizer, t, strings[t]))
            return [{**entry(e.token_id, e.logprob),
                     "top_logprobs": [entry(t, lp) for t, lp in zip(e.top_ids, e.top_logprobs)]}
                    for e in entries]
        return {"tokens": [strings[e.token_id] for e in entries],
                "token_logprobs": [None if e.logprob is None else max(e.logprob, MIN_LOGPROB) for e in entries],
                "top_logprobs": [None if e.top_ids is None else
                                 {**{strings[t]: max(lp, MIN_LOGPROB) for t, lp in zip(e.top_ids, e.top_logprobs)},
                                  strings[e.token_id]: max(e.logprob, MIN_LOGPROB)} for e in entries],
                "text_offset": offsets}

    def joined_logprobs(self):
        """The logprobs of every delta as one (the non-streamed reply's)."""
        if self.top_n is None:
            return None
        if self.chat:
            return {"content": [entry for part in self.logprobs for entry in part], "refusal": None}
        return {key: [value for part in self.logprobs for value in part[key]]
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def prompt_offsets(tokenizer: Tokenizer, text: str, ids: list[int]) -> list[int]:
    """Where each echoed prompt token starts in `text`; a token the text leaves out (a BOS the tokenizer added to a
    prompt sent as text) starts where the next one does."""
    stream = DecodeStream(skip_special_tokens=tokenizer.decode(ids, skip_special_tokens=False) != text)
    offsets, offset = [], 0
    for token in ids:
        offsets.append(offset)
        offset += len(stream.step(tokenizer, token) or "")
    return offsets


def token_entry(text: str, logprob: float, token_bytes: list[int]) -> dict:
    return {"token": text, "logprob": max(logprob, MIN_LOGPROB), "bytes": token_bytes}


# GPT-2's byte-level alphabet (the `tokenizers` ByteLevel decoder's: Qwen, Llama 3, DeepSeek, the embedded models):
# a byte is the character of its own code where that prints, else U+0100 onward in byte order.
_PRINTABLE = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
BYTE_LEVEL = {chr(b): b for b in _PRINTABLE} | {
    chr(0x100 + i): b for i, b in enumerate(b for b in range(256) if b not in _PRINTABLE)}
BYTE_FALLBACK = re.compile("<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens (Llama 2, Mistral)


def token_bytes(tokenizer: Tokenizer, token_id: int, text: str) -> list[int]:
    """A token's own bytes (OpenAI's `bytes`: joined across tokens they give the text). Its text's UTF-8, except
    for a token that is part of a character, whose text alone is U+FFFD (as vLLM's `token`): then the bytes its
    vocabulary entry stands for, a byte-level piece's character by character or a byte-fallback piece's byte."""
    if "\ufffd" not in text:
        return list(text.encode())
    piece = tokenizer.id_to_token(token_id) or ""
    if match := BYTE_FALLBACK.fullmatch(piece):
        return [int(match[1], 16)]
    if piece and all(c in BYTE_LEVEL for c in piece):
        return [BYTE_LEVEL[c] for c in piece]
    return list(text.encode())


def openai_router(deps: ServerDeps) -> APIRouter:
    """POST /v1/completions, /v1/chat/completions, /tokenize and /detokenize."""
    router = APIRouter()

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await complete(deps, body, request)

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await chat(deps, body, request)

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        deps.check_model(body)

        def run() -> list[int]:
            if body.messages is not None:
                return deps.encode(deps.render(body), bool(body.add_special_tokens))
            return deps.encode(body.prompt, body.add_special_tokens is not False)

        tokens = await deps.off_loop(run)
        strs = [deps.model.tokenizer.id_to_token(t) for t in tokens] if body.return_token_strs else None
        return {"count": len(tokens), "max_model_len": deps.model.max_model_len, "tokens": tokens, "token_strs": strs}

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        deps.check_model(body)
        vocab = deps.model.vocab_size
        if bad := next((t for t in body.tokens if not 0 <= t < vocab), None):
            raise APIError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})", "tokens")
        return {"prompt": await deps.off_loop(
            lambda: deps.model.tokenizer.decode(body.tokens, skip_special_tokens=False))}

    return router


def start(deps: ServerDeps, request_id: str, token_lists: list[list[int]], params: list, n: int,
          share_prompt: bool) -> list:
    """One engine stream per (prompt, choice): choice i of a prompt waits for choice 0's prompt pages."""
    return [deps.generator.generate(f"{request_id}-{i}", token_lists[i // n], p,
                                       after=f"{request_id}-{i - i % n}" if share_prompt and i % n else None)
            for i, p in enumerate(params)]


async def complete(deps: ServerDeps, body: CompletionRequest, request: Request):
    deps.check_model(body)
    deps.check_available()
    model, name = deps.model, deps.served_model_name
    prompts = body.prompt
    if isinstance(prompts, str) or not prompts or isinstance(prompts[0], int):
        prompts = [prompts]  # one prompt (an empty one is refused by check_length)
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    # echo + logprobs: the prompt's logprobs too; echo alone with max_tokens 0 still runs the prompt
    prompt_logprobs = body.logprobs if body.echo else None
    if body.echo and max_tokens == 0 and prompt_logprobs is None:
        prompt_logprobs = 0

    def prepare():
        token_lists = [deps.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        params = deps.check_sampling([body.sampling_params(deps.check_length(ids, max_tokens), j, body.logprobs,
                                                           prompt_logprobs)
                                      for ids in token_lists for j in range(body.n)])
        echoes = [(p if isinstance(p, str) else model.tokenizer.decode(ids, skip_special_tokens=False), ids)
                  for p, ids in zip(prompts, token_lists)] if body.echo else None
        return token_lists, params, echoes

    token_lists, params, echoes = await deps.off_loop(prepare)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    log_request(request_id, body, sum(map(len, token_lists)), max_tokens)
    streams = start(deps, request_id, token_lists, params, body.n, share_prompt=prompt_logprobs is None)
    choices = [Choice(i, model, False, body.logprobs, echoes[i // body.n] if echoes else None,
                      body.skip_special_tokens) for i in range(len(streams))]

    def chunk(choice: Choice, out: RequestOutput) -> dict:
        text, logprobs = choice.delta(out)
        return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": name,
                "choices": [with_token_ids(body, {"index": choice.index, "text": text, "logprobs": logprobs,
                                                  "finish_reason": out.finish_reason}, out.new_token_ids)]}

    if body.stream:
        return sse(name, body, streams, choices, chunk, request_id, "text_completion")
    await collect(streams, choices, request)
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": name,
            "choices": [with_token_ids(body, {"index": c.index, "text": c.text, "logprobs": c.joined_logprobs(),
                                              "finish_reason": c.final.finish_reason}, c.token_ids)
                        for c in choices],
            "usage": usage([c.final for c in choices], body.n)}


async def chat(deps: ServerDeps, body: ChatCompletionRequest, request: Request):
    deps.check_model(body)
    deps.check_available()
    name = deps.served_model_name
    top_n = (body.top_logprobs or 0) if body.logprobs else None

    def prepare():
        ids = deps.encode(deps.render(body), add_special_tokens=False)
        limit = deps.check_length(ids, body.max_completion_tokens or body.max_tokens)
        return ids, deps.check_sampling([body.sampling_params(limit, j, top_n) for j in range(body.n)])

    ids, params = await deps.off_loop(prepare)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    log_request(request_id, body, len(ids), params[0].max_tokens)
    streams = start(deps, request_id, [ids], params, body.n, share_prompt=True)
    final = body.messages[-1]
    echo = (final.text(), None) if body.echo and final.role == "assistant" else None  # vLLM's: same role only
    choices = [Choice(i, deps.model, True, top_n, echo) for i in range(body.n)]

    def chunk(choice: Choice, out: RequestOutput) -> dict:
        first = not choice.started
        text, logprobs = choice.delta(out)
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": name,
                "choices": [with_token_ids(body, {
                    "index": choice.index, "delta": delta,
                    "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
                    "finish_reason": out.finish_reason}, out.new_token_ids)]}

    if body.stream:
        return sse(name, body, streams, choices, chunk, request_id, "chat.completion.chunk")
    await collect(streams, choices, request)
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": name,
            "choices": [with_token_ids(body, {"index": c.index, "message": {"role": "assistant", "content": c.text},
                                              "logprobs": c.joined_logprobs(),
                                              "finish_reason": c.final.finish_reason}, c.token_ids)
                        for c in choices],
            "usage": usage([c.final for c in choices], body.n)}


def sse(served_model_name: str, body: SamplingRequest, streams, choices: list[Choice], chunk, request_id: str,
        object_name: str) -> StreamingResponse:
    async def events() -> AsyncIterator[dict]:
        try:
            async for index, out in merge(streams):
                choice = choices[index]
                event = chunk(choice, out)
                if body.continuous_usage:
                    event["usage"] = usage([out], 1)
                elif body.include_usage:
                    event["usage"] = None
                if out.finished:
                    choice.final = out
                yield event
            if body.include_usage:
                yield {"id": request_id, "object": object_name, "created": int(time.time()),
                       "model": served_model_name, "choices": [], "usage": usage([c.final for c in choices], body.n)}
        except Unavailable as exc:
            yield error_body(503, str(exc), type_="server_error")
        except EngineError as exc:
            yield error_body(500, str(exc), type_="server_error")
        except ValueError as exc:  # the request itself (as a non-streaming one gets 400)
            yield error_body(400, str(exc))

    return sse_response(events(), done=True)


async def collect(streams, choices: list[Choice], request: Request) -> None:
    """Run streams to the end into their choices; abort them if the client goes away."""
    async def run():
        async for index, out in merge(streams):
            choices[index].add(out, *choices[index].delta(out))

    task = asyncio.create_task(run())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            if not task.done() and await request.is_disconnected():
                raise APIError(499, "the client disconnected; the request was aborted", type_="client_closed_request")
    except BaseException:  # the client left, or this handler was cancelled (a forced shutdown): abort the
        task.cancel()      # request's streams, which frees its KV pages, instead of orphaning them
        await asyncio.gather(task, return_exceptions=True)
        raise
    try:
        task.result()
    except Unavailable as exc:
        raise APIError(503, str(exc), type_="server_error") from exc
    except EngineError as exc:
        raise APIError(500, str(exc), type_="server_error") from exc
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc


def with_token_ids(body: SamplingRequest, choice: dict, token_ids: list[int]) -> dict:
    """vLLM's `return_token_ids` extension: the generated token ids beside the text."""
    return {**choice, "token_ids": token_ids} if body.return_token_ids else choice


def usage(finals: list[RequestOutput], n: int) -> dict:
    """Token counts; a prompt with n choices counts once (OpenAI's usage)."""
    prompt = sum(f.num_prompt_tokens for f in finals[::n])
    completion = sum(f.num_output_tokens for f in finals)
    cached = sum(f.num_cached_tokens for f in finals[::n])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def merge(streams: list) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as items arrive, tagging each with its stream's index."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as stream:
            async for out in stream:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream) -> None:
        try:
            async with aclosing(stream):
                async for out in stream:
                    await queue.put((index, out))
        except Exception as exc:
            await queue.put((index, exc))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

"""The engine hands out token ids; the OutputProcessor beside it makes each request's outputs: text, stop strings
(found after the engine drew on), logprobs, usage and stamps."""
import random

from tokenizers import Tokenizer

from tsdev_runtime.engine.outputs import Finish, OutputProcessor, StepOutputs
from tsdev_runtime.engine.sequence import SamplingParams


def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


def text_tokens(tok: Tokenizer, seed: int, n: int) -> list[int]:
    """`n` random ids of the tokenizer that decode to text (not its specials)."""
    rng = random.Random(seed)
    return [rng.randrange(3, tok.get_vocab_size()) for _ in range(n)]


def test_a_stop_string_found_late_ends_the_request_at_it_and_later_tokens_are_dropped(tiny_model_dir):
    tok = tokenizer(tiny_model_dir)
    ids = text_tokens(tok, 0, 30)
    full = tok.decode(ids)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    processor = OutputProcessor(tok)
    processor.add("a", 5, SamplingParams(max_tokens=30, stop=[stop]))
    text, stopped_at = "", None
    for i, token in enumerate(ids):  # the engine draws on: it learns of the stop only when told
        outputs, stopped = processor.process(StepOutputs(time=float(i), request_ids=["a"], token_ids=[token]))
        if stopped_at is None:
            out, = outputs
            text += out.new_text
            if stopped:
                assert stopped == ["a"] and out.finished and out.finish_reason == "stop"
                stopped_at = i
        else:
            assert outputs == [] and stopped == []
    assert stopped_at is not None and text == full[: full.index(stop)]
    assert "a" not in processor.requests


def test_min_tokens_keeps_a_stop_string_from_ending_the_request_early(tiny_model_dir):
    tok = tokenizer(tiny_model_dir)
    ids = text_tokens(tok, 1, 12)
    stop = tok.decode(ids[:1])[:1]  # found in the first token's text
    processor = OutputProcessor(tok)
    processor.add("a", 3, SamplingParams(max_tokens=12, stop=[stop], min_tokens=12))
    for i, token in enumerate(ids[:-1]):
        outputs, stopped = processor.process(StepOutputs(time=float(i), request_ids=["a"], token_ids=[token]))
        assert not outputs[0].finished and not stopped
    final, = processor.process(StepOutputs(request_ids=["a"], token_ids=[ids[-1]],
                                           finished={"a": Finish("length", 2, 0.5)}))[0]
    assert final.finished and final.num_output_tokens == 12 and final.num_cached_tokens == 2


def test_logprobs_usage_stamps_and_a_tokenless_abort(tiny_model_dir):
    tok = tokenizer(tiny_model_dir)
    processor = OutputProcessor(tok)
    processor.add("a", 4, SamplingParams(max_tokens=5, logprobs=1, prompt_logprobs=0), arrival_time=1.0)
    processor.add("b", 4, SamplingParams(max_tokens=5), arrival_time=1.0)
    prompt = ([11, 12, 13], ([-1.0, -2.0, -3.0], [[-0.5], [-0.6], [-0.7]], [[11], [40], [13]]))
    outputs, _ = processor.process(StepOutputs(
        time=2.0, request_ids=["a", "b"], token_ids=[7, 8], logprobs={"a": (-0.25, [-0.25, -1.5], [7, 9])},
        prompt_logprobs={"a": prompt}, started={"a": (1.5, 4), "b": (1.25, 0)}))
    a, b = outputs
    assert [e.token_id for e in a.prompt_logprobs] == [11, 12, 13] and a.prompt_logprobs[1].top_ids == []
    assert a.logprobs[0].token_id == 7 and a.logprobs[0].top_ids == [7] and a.logprobs[0].logprob == -0.25
    assert (a.token_time, a.previous_token_time, a.first_scheduled_time, a.num_cached_tokens) == (2.0, None, 1.5, 4)
    assert b.logprobs is None and b.prompt_logprobs is None
    outputs, _ = processor.process(StepOutputs(time=3.0, request_ids=["a"], token_ids=[9],
                                               finished={"b": Finish("abort", 0, 1.25)}))
    a, b = outputs
    assert a.prompt_logprobs is None and (a.token_time, a.previous_token_time) == (3.0, 2.0)
    assert b.finished and b.finish_reason == "abort" and b.new_token_ids == [] and b.num_output_tokens == 1
    assert set(processor.requests) == {"a"}


def test_outputs_of_several_steps_handed_out_at_once_read_as_one(tiny_model_dir):
    first = StepOutputs(time=1.0, request_ids=["a"], token_ids=[5],
                        prompt_logprobs={"a": ([1], ([-1.0], [[-1.0]], [[1]]))})
    first.extend(StepOutputs(time=2.0, request_ids=["a"], token_ids=[6], finished={"a": Finish("stop", 0, None)},
                             prompt_logprobs={"a": ([2], ([-2.0], [[-2.0]], [[2]]))}))
    assert (first.time, first.request_ids, first.token_ids) == (2.0, ["a", "a"], [5, 6])
    assert first.prompt_logprobs["a"] == ([1, 2], ([-1.0, -2.0], [[-1.0], [-2.0]], [[1], [2]]))
    assert first.finished["a"].reason == "stop"


def test_offline_generate_decodes_once_what_a_stream_decodes_token_by_token(make_engine):
    """generate decodes a request without stop strings once, at the end (the tokenizer's decode of its tokens); a
    stream decodes token by token and holds back the bytes of a character not complete yet, so where the tokens
    end inside one the offline text ends with the replacement character the stream never sends."""
    from consumer import Consumer

    prompts = [[(13 * i + j) % 900 + 5 for j in range(4 + 3 * i)] for i in range(6)]
    params = [SamplingParams(max_tokens=24, temperature=0.9, seed=i, ignore_eos=True, skip_special_tokens=i % 2 == 0)
              for i in range(6)]
    offline = make_engine().generate(prompts, params)
    streamed = make_engine()
    consumer = Consumer(streamed)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        consumer.add(str(i), prompt, p)
    texts, tokens = [""] * 6, [[] for _ in range(6)]
    while streamed.has_unfinished():
        for out in consumer.step():
            texts[int(out.request_id)] += out.new_text
            tokens[int(out.request_id)] += out.new_token_ids
    assert [r["token_ids"] for r in offline] == tokens
    assert [r["text"] for r in offline] == [streamed.tokenizer.decode(t, skip_special_tokens=p.skip_special_tokens)
                                            for t, p in zip(tokens, params)]
    for r, text in zip(offline, texts):
        assert r["text"] == text or (r["text"].startswith(text) and set(r["text"][len(text):]) == {"\ufffd"})
    assert sum(r["text"] == text for r, text in zip(offline, texts)) >= 3
    assert {r["finish_reason"] for r in offline} == {"length"}


def test_a_stopping_server_ends_every_request_keeping_what_is_known_of_it(tiny_model_dir):
    processor = OutputProcessor(tokenizer(tiny_model_dir))
    for rid in ("a", "b"):
        processor.add(rid, 4, SamplingParams(max_tokens=8), arrival_time=1.0)
    processor.process(StepOutputs(time=2.0, request_ids=["a"], token_ids=[7], started={"a": (1.5, 4)}))
    a, b = processor.end_all("abort")
    assert (a.finished, a.finish_reason, a.num_output_tokens, a.num_cached_tokens, a.first_scheduled_time) == (
        True, "abort", 1, 4, 1.5)
    assert (b.finish_reason, b.num_output_tokens, b.new_token_ids) == ("abort", 0, [])
    assert processor.requests == {}

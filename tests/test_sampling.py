import pytest
import torch

from tsdev_runtime.engine.sequence import SamplingParams
from tsdev_kernels.ops.sampling import apply_top_k_top_p
from tsdev_runtime.sampling.sampler import max_top_k

PROMPT = [11, 22, 33, 44, 55]


@pytest.mark.slow
def test_seeded_sampling_repeats_whatever_the_batch(make_engine):
    engine = make_engine()
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    alone = engine.generate([PROMPT], seeded)[0]["token_ids"]
    other = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    batched = engine.generate([[9, 8, 7], PROMPT, [1, 2]], [other, seeded, other])[1]["token_ids"]
    assert alone == batched
    different = engine.generate([PROMPT], SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True))
    assert different[0]["token_ids"] != alone


@pytest.mark.slow
def test_top_k_one_is_greedy(make_engine):
    engine = make_engine()
    greedy = engine.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    top1 = engine.generate([PROMPT], SamplingParams(max_tokens=10, temperature=1.5, top_k=1, ignore_eos=True))
    assert greedy[0]["token_ids"] == top1[0]["token_ids"]


def test_top_k_top_p_masks_per_row():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]]))
    out = apply_top_k_top_p(logits, torch.tensor([0, 2]), torch.tensor([0.7, 1.0]))
    assert torch.isfinite(out).tolist() == [[True, True, False, False], [False, False, True, True]]


@pytest.mark.slow
def test_stop_string_ends_generation_and_is_not_returned(make_engine):
    engine = make_engine()
    full = engine.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    text = full["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip() and text.index(stop) > 0
    cut = engine.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == text[: text.index(stop)]
    assert len(cut["token_ids"]) < len(full["token_ids"])


@pytest.mark.slow
def test_eos_stops_unless_ignored(make_engine):
    engine = make_engine()
    out = engine.generate([PROMPT], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]["token_ids"]
    engine.eos = {out[3]}  # pretend the 4th generated token is the end of sequence
    stopped = engine.generate([PROMPT], SamplingParams(max_tokens=30, temperature=0))[0]
    assert stopped["token_ids"] == out[: out.index(out[3]) + 1] and stopped["finish_reason"] == "stop"
    ignored = engine.generate([PROMPT], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    assert ignored["token_ids"] == out and ignored["finish_reason"] == "length"


def test_the_kernel_path_promise_follows_the_rows_parameters():
    assert max_top_k([0, 0], [1.0, 1.0]) == 0
    assert max_top_k([5, 40], [1.0, 0.9]) == 40
    assert max_top_k([5, 0], [1.0, 1.0]) is None  # one row unfiltered, another top-k: full sort
    assert max_top_k([0], [0.9]) is None


def test_detokenizer_skips_ids_the_tokenizer_lacks_and_holds_split_characters(make_engine):
    from tsdev_runtime.engine.detokenizer import Detokenizer

    tokenizer = make_engine().tokenizer
    unknown = tokenizer.get_vocab_size() + 5  # the model's vocabulary is larger than the tokenizer's
    text = " héllo wörld 😀"
    ids = tokenizer.encode(text).ids
    detok, seen = Detokenizer(tokenizer, stop=[]), []
    for token in [unknown] * 50 + ids:
        detok.add(token)
        seen.append(detok.delta(finished=False))
        assert "\ufffd" not in seen[-1]
    assert detok.text == "".join(seen) == text


def test_detokenizer_stops_at_a_stop_string_split_across_tokens(make_engine):
    from tsdev_runtime.engine.detokenizer import Detokenizer

    tokenizer = make_engine().tokenizer
    detok, ids = Detokenizer(tokenizer, stop=["lo wo"]), tokenizer.encode(" hello world").ids
    assert not any("lo wo" in tokenizer.decode([token]) for token in ids)  # no one token holds it
    streamed = ""
    for token in ids:
        if detok.add(token):
            break
        streamed += detok.delta(finished=False)
    assert "lo w" not in streamed and streamed + detok.delta(finished=True) == " hel"

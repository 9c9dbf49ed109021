"""Checkpoint loading: the default model, sharded checkpoints, and errors that say what is wrong."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tsdev_runtime.config import EngineConfig
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.engine.sequence import SamplingParams
from tsdev_runtime.weights import default_model

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.mark.slow
def test_default_checkpoint_is_created_once_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("TSDEV_CACHE_DIR", str(tmp_path))
    first = default_model.default_model_dir("cpu")
    assert {p.name for p in first.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json",
                                                  "generation_config.json", "tokenizer_config.json"}
    stamp = os.stat(first / "model.safetensors").st_mtime_ns
    writes = []
    monkeypatch.setattr(default_model, "write_checkpoint", lambda *a, **k: writes.append(a))
    assert default_model.default_model_dir("cpu") == first
    assert writes == [] and os.stat(first / "model.safetensors").st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == [first.name]  # no temp dirs left behind
    engine = LLMEngine(EngineConfig(model=None, device="cpu", kv_pages=256))
    assert engine.model_dir == first
    assert engine.model_config.hidden_size == default_model.SHAPES["tiny"]["hidden_size"]


@pytest.mark.slow
def test_a_checkpoint_written_ahead_is_waited_for_not_written_twice(tmp_path, monkeypatch, caplog, capfd):
    """`tsdev serve` on a GPU starts writing the default checkpoint in a process of its own before it imports torch
    (`write_ahead`); its load then waits for that process instead of writing a second copy beside it."""
    import logging

    monkeypatch.setenv("TSDEV_CACHE_DIR", str(tmp_path))
    writer = default_model.write_ahead("cpu", None)
    with caplog.at_level(logging.INFO, logger="tsdev_runtime.startup"):
        final = default_model.default_model_dir("cpu")
    assert writer.wait(120) == 0
    here = sum("writing the default checkpoint" in r.getMessage() for r in caplog.records)
    there = capfd.readouterr().err.count("writing the default checkpoint")
    assert here + there == 1, (here, there)  # one of the two wrote it, whichever took the lock first
    assert (final / "config.json").is_file() and [p.name for p in tmp_path.iterdir() if p.is_dir()] == [final.name]
    assert default_model.write_ahead("cpu", None) is None  # there now: nothing to start


def test_the_default_models_names_and_place_come_without_torch():
    import subprocess
    import sys

    code = ("import sys; from tsdev_runtime.weights import default_model as d; d.checkpoint_dir('cuda', 'default-mla');"
            " print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


@pytest.mark.parametrize("shape", ["tiny", "qwen3-0.6b"])
def test_every_id_of_the_default_tokenizer_decodes_to_text(shape):
    """The model samples ids 0..vocab_size-1: each decodes (as the engine decodes, skipping special tokens)
    to non-empty text, except the special tokens, which end a request (EOS). The 0.6B shape's tokenizer
    is built alone, without its 1.2 GB of weights."""
    vocab_size = default_model.SHAPES[shape]["vocab_size"]
    tokenizer = default_model.build_tokenizer(vocab_size)
    assert tokenizer.get_vocab_size() == vocab_size
    texts = tokenizer.decode_batch([[i] for i in range(vocab_size)])
    specials = {tokenizer.token_to_id(t) for t in default_model.SPECIAL_TOKENS}
    assert {i for i, text in enumerate(texts) if not text} == specials
    assert set(default_model.eos_token_ids(tokenizer)) == specials
    assert [tokenizer.decode([i], skip_special_tokens=False) for i in sorted(specials)] == default_model.SPECIAL_TOKENS
    assert len({tokenizer.id_to_token(i) for i in range(vocab_size)}) == vocab_size  # distinct tokens
    text = " the serving engine writes conversations"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


@pytest.mark.slow
def test_default_model_completes_prompts_with_text(tmp_path, monkeypatch):
    """Greedy completions of the tiny default model (CPU) are text, not empty strings."""
    monkeypatch.setenv("TSDEV_CACHE_DIR", str(tmp_path))
    engine = LLMEngine(EngineConfig(model=None, device="cpu", kv_pages=256))
    assert engine.tokenizer.get_vocab_size() == engine.model_config.vocab_size
    special = {engine.tokenizer.token_to_id(t) for t in default_model.SPECIAL_TOKENS}
    assert engine.eos == special
    prompts = ["Hello, my name is", "The capital of France is", "def fibonacci(n):", "Once upon a time",
               "<|im_start|>user\nWhat is a kernel?<|im_end|>\n<|im_start|>assistant\n"]
    outputs = engine.generate([engine.tokenizer.encode(p).ids for p in prompts],
                              SamplingParams(max_tokens=16, temperature=0))
    for prompt, out in zip(prompts, outputs):
        assert out["text"].strip(), (prompt, out)


@pytest.mark.slow
def test_sharded_checkpoint_gives_the_same_tokens(tiny_model_dir, tmp_path):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    expected = LLMEngine(EngineConfig(model=str(tiny_model_dir), kv_pages=64)).generate([prompt], GREEDY)
    for name in os.listdir(tiny_model_dir):
        if name != "model.safetensors":
            shutil.copy(tiny_model_dir / name, tmp_path / name)
    tensors = load_file(tiny_model_dir / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, tmp_path / file)
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    got = LLMEngine(EngineConfig(model=str(tmp_path), kv_pages=64)).generate([prompt], GREEDY)
    assert got[0]["token_ids"] == expected[0]["token_ids"]


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("breakage, message", [
    ("no-config", "has no config.json"),
    ("no-weights", "neither model.safetensors"),
    ("arch", "not supported"),
    ("missing-tensor", "lacks 1 tensor"),
    ("extra-tensor", "does not use"),
    ("bad-shape", "has shape"),
    ("no-tokenizer", "no tokenizer.json"),
])
def test_broken_checkpoints_fail_with_a_clear_message(tiny_model_dir, tmp_path, breakage, message):
    ckpt = copy_checkpoint(tiny_model_dir, tmp_path / "ckpt")
    weights = ckpt / "model.safetensors"
    if breakage == "no-config":
        (ckpt / "config.json").unlink()
    elif breakage == "no-weights":
        weights.unlink()
    elif breakage == "no-tokenizer":
        (ckpt / "tokenizer.json").unlink()
    elif breakage == "arch":
        config = json.loads((ckpt / "config.json").read_text())
        (ckpt / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    else:
        tensors = load_file(weights)
        if breakage == "missing-tensor":
            del tensors["model.layers.1.mlp.up_proj.weight"]
        elif breakage == "extra-tensor":
            tensors["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2)
        else:
            tensors["model.norm.weight"] = torch.ones(3)
        save_file(tensors, weights)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        LLMEngine(EngineConfig(model=str(ckpt), kv_pages=64))


def test_missing_model_directory_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope is neither a directory nor a model embedded in tsdev"):
        LLMEngine(EngineConfig(model=str(tmp_path / "nope")))

"""The model split over two gloo ranks (tensor parallelism on the CPU) computes what one process does: the same
logits (to float32 rounding: the ranks sum partial products in another order) and the same greedy tokens, with
each rank holding and loading only its part of the checkpoint."""
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ranks import run_ranks
from tolerances import assert_logits_close
from tsdev_runtime import distributed
from tsdev_runtime.config import EngineConfig, ModelConfig
from tsdev_runtime.engine.block_manager import BlockManager
from tsdev_runtime.engine.model_runner import Checkpoint, ModelRunner
from tsdev_runtime.engine.scheduler import ScheduledBatch
from tsdev_runtime.engine.sequence import SamplingParams, Sequence
from tsdev_runtime.models import build_model
from tsdev_runtime.weights.default_model import SHAPES, random_weights, write_checkpoint
from tsdev_runtime.weights.loader import check_checkpoint

pytestmark = pytest.mark.slow  # spawns servers or rank processes (pytest -m 'not slow': the quick loop)

PROMPTS = [[(7 * j + 3) % 1000 + 1 for j in range(13)], [(11 * j + 5) % 1000 + 1 for j in range(6)]]
DECODE_STEPS = 3
GREEDY = SamplingParams(max_tokens=DECODE_STEPS + 1, temperature=0, ignore_eos=True)


def generate(model_dir: str, update: str | None = None, quantization: str | None = None) -> dict:
    """On this rank: load `model_dir` (then, if given, the weights file `update` as a streamed weight update),
    prefill PROMPTS in one batch and decode DECODE_STEPS greedy tokens; each step's logits, the tokens, and the
    parameters' shapes."""
    config = EngineConfig(model=model_dir, device="cpu", dtype="float32", enforce_eager=True, page_size=4,
                          kv_pages=32, max_model_len=64, max_running=4, max_batched_tokens=64,
                          quantization=quantization)
    runner = ModelRunner(config, Checkpoint.open(config))
    if update:
        runner.weights.prepare_update(Path(model_dir))
        runner.weights.load_tensors(load_file(update).items())
    blocks = BlockManager(runner.num_pages, config.page_size, True)
    seqs = [Sequence(f"s{i}", prompt, GREEDY) for i, prompt in enumerate(PROMPTS)]
    batch, logits, tokens = ScheduledBatch(seqs, [len(p) for p in PROMPTS]), [], []
    for _ in range(DECODE_STEPS + 1):
        for seq, n in zip(batch.seqs, batch.num_tokens):
            assert blocks.allocate(seq, n)
        step = runner.compute_logits(batch, use_graphs=False)
        logits.append(step.tolist())
        tokens.append(step.argmax(-1).tolist())
        for seq, n, token in zip(batch.seqs, batch.num_tokens, tokens[-1]):
            seq.num_computed_tokens += n
            seq.token_ids.append(token)
        batch = ScheduledBatch(seqs, [1] * len(seqs))
    shapes = {name: tuple(p.shape) for name, p in runner.model.named_parameters(remove_duplicate=False)}
    return dict(logits=logits, tokens=tokens, shapes=shapes)


def assert_same_generation(single: dict, ranks: list[dict]) -> None:
    for out in ranks:
        assert out["tokens"] == single["tokens"]
        for step, (want, got) in enumerate(zip(single["logits"], out["logits"])):
            try:
                assert_logits_close(torch.tensor(got), torch.tensor(want))
            except AssertionError as exc:
                raise AssertionError(f"step {step}: {exc}") from None


@pytest.fixture(scope="module")
def tiny_tp2(tiny_model_dir):
    """(TP=1 in this process, the two ranks' results) on the tests' tiny checkpoint."""
    config = ModelConfig.from_dir(tiny_model_dir)
    assert config.num_attention_heads % 2 == 0 and config.num_key_value_heads % 2 == 0
    return generate(str(tiny_model_dir)), run_ranks(generate, 2, str(tiny_model_dir))


def test_two_ranks_compute_the_logits_and_greedy_tokens_of_one(tiny_tp2, tiny_model_dir):
    assert ModelConfig.from_dir(tiny_model_dir).tie_word_embeddings  # the split lm_head is the embedding's rows
    assert_same_generation(*tiny_tp2)


def test_each_rank_holds_its_part_of_every_split_parameter(tiny_tp2):
    single, ranks = tiny_tp2
    halved = {  # parameter name ending -> the dimension split over the ranks
        "qkv_proj.weight": 0, "gate_up_proj.weight": 0, "o_proj.weight": 1, "down_proj.weight": 1,
        "embed_tokens.weight": 0, "lm_head.weight": 0,
    }
    assert ranks[0]["shapes"] == ranks[1]["shapes"]
    for name, shape in single["shapes"].items():
        dim = next((d for suffix, d in halved.items() if name.endswith(suffix)), None)
        want = shape if dim is None else tuple(n // 2 if i == dim else n for i, n in enumerate(shape))
        assert ranks[0]["shapes"][name] == want, name


def test_untied_logits_over_a_padded_vocabulary_and_a_weight_update_under_two_ranks(tmp_path):
    """1023 ids: each rank holds 512 rows, the last one padding; a separate lm_head; then a streamed update."""
    shape = {**SHAPES["tiny"], "vocab_size": 1023, "max_position_embeddings": 64}
    write_checkpoint(tmp_path, shape, seed=3, std=0.2)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    weights = load_file(tmp_path / "model.safetensors")
    lm_head = torch.randn(shape["vocab_size"], shape["hidden_size"], generator=torch.Generator().manual_seed(4)) * 0.2
    weights["lm_head.weight"] = lm_head
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    update = tmp_path / "update.safetensors"
    save_file({**random_weights(shape, 5, 0.2, torch.float32), "lm_head.weight": lm_head * 0.5}, update)

    for args in ((str(tmp_path),), (str(tmp_path), str(update))):
        single, ranks = generate(*args), run_ranks(generate, 2, *args)
        assert len(single["logits"][0][0]) == 1023
        assert ranks[1]["shapes"]["lm_head.weight"] == (512, shape["hidden_size"])
        assert_same_generation(single, ranks)


def test_fp8_projections_under_two_ranks_are_as_close_to_float32_as_on_one(tiny_tp2, tiny_model_dir):
    """Each rank quantizes its own slice (row-parallel ones: scales over its columns only), so the logits are not
    those of one fp8 process, but as close to the float32 ones (the prefill's: identical inputs)."""
    exact = torch.tensor(tiny_tp2[0]["logits"][0])
    single = torch.tensor(generate(str(tiny_model_dir), quantization="fp8")["logits"][0])
    ranks = run_ranks(generate, 2, str(tiny_model_dir), None, "fp8")
    for out in ranks:
        error = (torch.tensor(out["logits"][0]) - exact).abs().mean()
        assert 0 < error < 1.5 * (single - exact).abs().mean()


@pytest.mark.parametrize("heads, kv_heads, what", [(4, 2, "attention heads (4)"), (6, 2, "key/value heads (2)")])
def test_a_tensor_parallel_size_that_does_not_divide_the_heads_fails_naming_them(tiny_model_dir, monkeypatch, heads,
                                                                                 kv_heads, what):
    config = dataclasses.replace(ModelConfig.from_dir(tiny_model_dir), num_attention_heads=heads,
                                 num_key_value_heads=kv_heads)
    monkeypatch.setattr(distributed, "size", lambda: 3)
    with pytest.raises(ValueError, match=re.escape(f"the {what} does not divide by the tensor-parallel size 3")):
        build_model(config, "cpu", torch.float32)


def test_a_checkpoint_of_another_shape_fails_naming_the_tensor_and_its_full_shape(tiny_model_dir, tmp_path):
    """The ranks check the checkpoint against the full shapes (not their slices)."""
    run_ranks(check_mismatch, 2, str(tiny_model_dir), str(tmp_path))


def check_mismatch(model_dir: str, tmp: str) -> None:
    config = ModelConfig.from_dir(Path(model_dir))
    model = build_model(config, "cpu", torch.float32)
    check_checkpoint(model, Path(model_dir))  # the full tensors fit every rank
    out = Path(tmp) / f"rank{distributed.rank()}"
    out.mkdir()
    weights = load_file(Path(model_dir) / "model.safetensors")
    name = "model.layers.0.self_attn.o_proj.weight"
    weights[name] = weights[name][:, : config.hidden_size // 2].contiguous()  # one rank's columns: not a checkpoint
    save_file(weights, out / "model.safetensors")
    with pytest.raises(ValueError, match=rf"{name} has shape \(64, 32\), the model expects \(64, 64\)"):
        check_checkpoint(model, out)


def staged_slices_equal_plain(model_dir: str) -> dict:
    """On this rank: the staged path reading only this rank's rows (where the slice is along the first dimension)
    loads exactly what the plain path (whole tensors, narrowed) loads; the bytes it read."""
    from tsdev_runtime.weights.checkpoint import checkpoint_files, read_entries
    from tsdev_runtime.weights.loader import LoadSession, _Targets, load_weights
    from tsdev_runtime.weights.pinned import StagedLoad

    config = ModelConfig.from_dir(Path(model_dir))
    plain = build_model(config, "cpu", torch.float32)
    load_weights(plain, Path(model_dir), "plain")
    staged = build_model(config, "cpu", torch.float32)
    entries = read_entries(checkpoint_files(Path(model_dir)))
    targets = _Targets(staged)
    ranges = targets.byte_ranges(entries)
    targets.check(entries, Path(model_dir))
    session = LoadSession(staged, targets.keys, reprocessing=False)
    with StagedLoad(ranges, torch.device("cpu"), 1 << 30, pin=False) as load:
        for name, tensor in load:
            targets.load(name, tensor, session)
    session.finish()
    same = all(torch.equal(a, b) for a, b in zip(plain.parameters(), staged.parameters()))
    return dict(same=same, read=sum(e.nbytes for e in ranges), whole=sum(e.nbytes for e in entries))


def test_each_rank_reads_only_its_rows_of_the_checkpoint_where_they_are_contiguous(tiny_model_dir):
    for out in run_ranks(staged_slices_equal_plain, 2, str(tiny_model_dir)):
        assert out["same"]
        assert out["read"] < 0.8 * out["whole"]  # q|k|v, gate|up and the vocabulary: half; o_proj, down_proj: whole

"""Pinned staging load on CPU: the byte-range reader against safetensors' own, the chunk planner, the
staged pipeline (unpinned) bit-identical to the plain path, and the fallback when pinning fails.
The CUDA side (registration, side stream, events) is tests/test_weights_gpu.py."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tsdev_runtime.config import EngineConfig, ModelConfig, parse_size
from tsdev_runtime.models import MODELS
from tsdev_runtime.weights import pinned
from tsdev_runtime.weights.checkpoint import TensorEntry, checkpoint_files, read_entries
from tsdev_runtime.weights.loader import load_weights
from tsdev_runtime.weights.pinned import ALIGN, PinningUnavailable, StagedLoad, plan_chunks, slot_bytes_for


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor (so NaNs and -0.0 compare by bit pattern)."""
    return t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def odd_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    floats = torch.randn(37, 129, generator=g)
    floats[0, :3] = torch.tensor([float("nan"), -0.0, float("inf")])
    return {
        "a.bf16": floats.to(torch.bfloat16), "b.f32": floats, "c.f16": floats[:5].to(torch.float16),
        "d.i64": torch.randint(-2**40, 2**40, (1000,), generator=g),
        "e.i32": torch.randint(-99, 99, (3, 7), generator=g, dtype=torch.int32),
        "f.u8": torch.randint(0, 255, (4099,), generator=g, dtype=torch.uint8),
        "g.bool": torch.rand(17, generator=g) > 0.5,
        "h.scalar": torch.tensor(3.5), "i.empty": torch.empty(0, 4), "j.i8": torch.arange(-5, 6, dtype=torch.int8),
        "k.big": torch.randn(300_000, generator=g),  # 1.2 MB: larger than the small slots below, so it is split
    }


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory):
    """A two-shard checkpoint (with an index) of tensors of every common dtype and shape oddity."""
    out = tmp_path_factory.mktemp("sharded")
    tensors = odd_tensors(0)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, out / file)
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return out


def reference(model_dir) -> dict[str, torch.Tensor]:
    return {k: v for path in checkpoint_files(model_dir) for k, v in load_file(path).items()}


def test_headers_give_every_tensor_as_a_byte_range(sharded_dir):
    expected = reference(sharded_dir)
    entries = read_entries(checkpoint_files(sharded_dir))
    assert sorted(e.name for e in entries) == sorted(expected)
    for e in entries:
        with open(e.path, "rb") as f:
            f.seek(e.offset)
            raw = f.read(e.nbytes)
        assert (e.dtype, e.shape) == (expected[e.name].dtype, tuple(expected[e.name].shape))
        assert raw == bits(expected[e.name]).numpy().tobytes(), e.name


@pytest.mark.parametrize("memory_limit", [2 * ALIGN, 64 << 10, 1 << 30], ids=["256B-slots", "32KiB-slots", "one-chunk"])
def test_staged_tensors_are_bit_identical_to_safetensors(sharded_dir, memory_limit):
    expected = reference(sharded_dir)
    entries = read_entries(checkpoint_files(sharded_dir))
    with StagedLoad(entries, torch.device("cpu"), memory_limit, pin=False) as load:
        got = {name: tensor.clone() for name, tensor in load}
    assert sorted(got) == sorted(expected)
    for name, tensor in got.items():
        assert tensor.dtype == expected[name].dtype and tensor.shape == expected[name].shape, name
        assert torch.equal(bits(tensor), bits(expected[name])), name


def test_chunk_plan_packs_in_order_splits_only_what_exceeds_a_slot(sharded_dir):
    entries = read_entries(checkpoint_files(sharded_dir))
    slot = 64 << 10
    chunks = plan_chunks(entries, slot)
    pieces = [p for c in chunks for p in c.pieces]
    assert [p.entry.name for p in pieces if p.start == 0] == [e.name for e in entries]  # file order
    for chunk in chunks:
        assert 0 < chunk.nbytes <= slot
        assert all(p.at % ALIGN == 0 for p in chunk.pieces)
        spans = sorted((p.at, p.at + p.nbytes) for p in chunk.pieces)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no overlap
    for e in entries:
        mine = [p for p in pieces if p.entry is e]
        assert sum(p.nbytes for p in mine) == e.nbytes and [p.start for p in mine] == sorted(p.start for p in mine)
        assert len(mine) == (1 if e.nbytes <= slot else -(-e.nbytes // slot))


def test_two_slots_fit_the_limit_and_none_is_larger_than_the_checkpoint(sharded_dir):
    def slot(total: int, limit: int = 16 << 30) -> int:
        return slot_bytes_for([TensorEntry("w", sharded_dir, torch.uint8, (total,), 0, total)], limit)

    assert slot(16 << 30) == pinned.SLOT_BYTES == 64 << 20
    assert slot(1 << 20) == 1 << 20 and slot(1000) == 1024  # never (much) above the checkpoint
    assert slot(16 << 30, limit=40 << 20) == 20 << 20  # two slots within --load-memory-limit
    with pytest.raises(ValueError, match="--load-memory-limit"):
        slot(1 << 20, limit=100)


def test_a_truncated_checkpoint_is_named_before_any_data_is_read(sharded_dir, tmp_path):
    data = (sharded_dir / "model-00001-of-00002.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-10])
    with pytest.raises(ValueError, match="truncated"):
        read_entries(checkpoint_files(tmp_path))


# --- load_weights: pinned vs plain, and the fallback ----------------------------------------------------


def tiny_model(model_dir):
    config = ModelConfig.from_dir(model_dir)
    return MODELS[config.architecture](config)


def model_bits(model) -> dict[str, torch.Tensor]:
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {name: bits(t.detach()).clone() for name, t in tensors.items()}


def assert_identical(a, b):
    ma, mb = model_bits(a), model_bits(b)
    assert ma.keys() == mb.keys()
    for name in ma:
        assert torch.equal(ma[name], mb[name]), name


@pytest.fixture
def fake_pinning(monkeypatch):
    """Let the staged path run on CPU as if pinning worked (registration a no-op); returns the calls."""
    calls = []
    monkeypatch.setattr(pinned, "check_pinnable", lambda device: None)
    monkeypatch.setattr(pinned, "host_register", lambda ptr, n: calls.append(("register", n)) or
                        (lambda: calls.append(("unregister", n))))
    return calls


def test_pinned_staging_loads_the_same_bits_as_plain(tiny_model_dir, fake_pinning, monkeypatch, capsys):
    buffers = []
    monkeypatch.setattr(pinned.HostBuffer, "pin",
                        lambda self, pin=pinned.HostBuffer.pin: buffers.append(self) or pin(self))
    plain = tiny_model(tiny_model_dir)
    assert load_weights(plain, tiny_model_dir, "plain").report.format == "plain"
    staged = tiny_model(tiny_model_dir)
    # 8 KiB slots: splits the embedding
    report = load_weights(staged, tiny_model_dir, "pinned", memory_limit=16 << 10).report
    assert report.format == "pinned" and "chunk(s)" in report.detail
    assert_identical(plain, staged)
    assert [c[0] for c in fake_pinning] == ["register", "unregister"]  # and the buffer is unmapped:
    assert len(buffers) == 1 and buffers[0]._map.closed
    assert "warning" not in capsys.readouterr().err


def test_a_failing_register_falls_back_to_plain_with_one_warning(tiny_model_dir, monkeypatch, capsys):
    def fail(ptr, n):
        raise PinningUnavailable("cudaHostRegister failed with cudaError 2 (simulated)")

    monkeypatch.setattr(pinned, "check_pinnable", lambda device: None)
    monkeypatch.setattr(pinned, "host_register", fail)
    closed = []
    monkeypatch.setattr(pinned.HostBuffer, "close",
                        lambda self, close=pinned.HostBuffer.close: closed.append(1) or close(self))
    fallback = tiny_model(tiny_model_dir)
    assert load_weights(fallback, tiny_model_dir, "pinned").report.format == "plain"
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "simulated" in err and "--load-format plain" in err
    assert closed == [1]  # the staging buffer was unmapped
    plain = tiny_model(tiny_model_dir)
    load_weights(plain, tiny_model_dir, "plain")
    assert_identical(plain, fallback)


def test_on_cpu_auto_is_plain_and_pinned_falls_back_with_a_warning(tiny_model_dir, capsys):
    assert load_weights(tiny_model(tiny_model_dir), tiny_model_dir).report.format == "plain"
    assert capsys.readouterr().err == ""
    assert load_weights(tiny_model(tiny_model_dir), tiny_model_dir, "pinned").report.format == "plain"
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "nothing to pin for" in err
    with pytest.raises(ValueError, match="auto, pinned, plain"):
        load_weights(tiny_model(tiny_model_dir), tiny_model_dir, "fast")


def test_serve_flags_reach_the_engine_config(monkeypatch):
    from test_cli import engine_config

    config = engine_config(monkeypatch, "--load-format", "plain", "--load-memory-limit", "512MiB")
    assert (config.load_format, config.load_memory_limit) == ("plain", 512 << 20)
    default = engine_config(monkeypatch)
    assert (default.load_format, default.load_memory_limit) == ("auto", EngineConfig.load_memory_limit)
    assert parse_size("16GiB") == EngineConfig.load_memory_limit and parse_size("16GB") == 16 * 10**9

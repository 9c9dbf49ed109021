"""A restart's weights handed from the stopping server to the standby (runtime/tsdev_runtime/weights/handover.py): on
the CPU through shared memory, the same protocol and the same copy-in as CUDA IPC on a GPU."""
import threading
import time
from pathlib import Path

import pytest

from tsdev_runtime.control_protocol import restart_marker
from tsdev_runtime.engine.sequence import SamplingParams
from tsdev_runtime.engine.sleep import weights_checksum
from tsdev_runtime.weights import handover, loader

PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79]]


def greedy(engine) -> list[list[int]]:
    return [o["token_ids"] for o in engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12))]


def hand_over(engine, path, late: bool = False) -> tuple[str, handover.Received | None]:
    """A restart's hand-over as the two processes run it: tsdev watch's marker, the stopping server's offer (in this
    thread), the standby's connect and receive (in another; `late`: a standby still importing, which connects
    after the server began to offer)."""
    listener = handover.Listener(str(path))
    Path(restart_marker(str(path))).touch()
    got = {}

    def standby():
        if late:
            time.sleep(0.5)
        got.update(received=handover.receive(handover.connect(str(path)), wait_s=30))
    receiver = threading.Thread(target=standby)
    receiver.start()
    if not late:
        time.sleep(0.2)  # (connected before the offer: either order works, both are tested)
    outcome = engine.runner.offer_weights(listener, engine.control.weights_loaded)
    receiver.join(60)
    return outcome, got.get("received")


def test_a_restart_serves_the_handed_over_weights_without_reading_the_checkpoint(make_engine, tmp_path,
                                                                                   monkeypatch):
    old = make_engine()
    expected, checksum = greedy(old), weights_checksum(old.runner.model)
    outcome, received = hand_over(old, tmp_path / "w.sock")
    assert received is not None and outcome.startswith(f"{len(received.tensors)} tensors copied by the standby in ")
    assert "one buffer of" in outcome  # packed: one allocation mapped, one copy
    assert len({t.untyped_storage().data_ptr() for t in received.tensors.values()}) == 1
    assert "this server waited" in outcome and "its answer" in outcome  # where the stopping server's wait went
    assert not old.runner.kv_cache.untyped_storage().nbytes()  # the stopping server freed its KV pool first
    del old
    handover.hold(received)
    monkeypatch.setattr(loader, "_tensor_source", lambda *a, **k: pytest.fail("the checkpoint was read"))
    new = make_engine()
    assert new.runner.load_report.format == "handed over"
    assert not received.tensors  # the standby's copies let go once the model holds the weights (the KV pool's room)
    assert weights_checksum(new.runner.model) == checksum  # derived tensors too: the hooks ran after the copy
    assert greedy(new) == expected
    assert handover.take(tmp_path, new.config) == (None, "")  # taken once


def test_an_edit_of_the_models_code_since_the_load_means_a_read(make_engine, tmp_path, monkeypatch):
    """The fingerprint covers the code that builds and fills a model: a standby whose layers' source differs from
    what the stopping server loaded with reads the checkpoint, and says why. (This standby connects late, still
    importing when the restart came: the stopping server waits for it.)"""
    old = make_engine()
    expected = greedy(old)
    _, received = hand_over(old, tmp_path / "w.sock", late=True)
    assert received is not None
    handover.hold(received)
    real = handover.fingerprint
    monkeypatch.setattr(handover, "fingerprint", lambda model_dir, config: real(model_dir, config) + "-edited")
    new = make_engine()
    assert new.runner.load_report.format != "handed over"
    assert "model's code changed" in new.runner.load_report.detail
    assert greedy(new) == expected


def test_weights_updated_in_place_are_not_offered(make_engine, tiny_model_dir, tmp_path):
    """After a weight update the server serves what the update brought; a restart reads the checkpoint the user
    names, so nothing is offered (and no standby waits for an answer)."""
    engine = make_engine()
    engine.runner.begin_update(tiny_model_dir)
    listener = handover.Listener(str(tmp_path / "w.sock"))
    Path(restart_marker(str(tmp_path / "w.sock"))).touch()
    assert engine.runner.offer_weights(listener, True).startswith("weights not offered")
    assert not (tmp_path / "w.sock").exists()


def test_a_server_stopped_for_good_offers_nothing_and_waits_for_no_one(make_engine, tmp_path):
    """Without tsdev watch's restart marker (it quits, or the server was stopped otherwise) nothing is offered; with
    it, a standby that never connects is waited for a bounded time."""
    engine = make_engine()
    listener = handover.Listener(str(tmp_path / "w.sock"))
    assert engine.runner.offer_weights(listener, True) == "not a restart"
    assert handover.connect(str(tmp_path / "w.sock")) is None  # the socket is gone
    listener = handover.Listener(str(tmp_path / "w.sock"))
    Path(restart_marker(str(tmp_path / "w.sock"))).touch()
    assert listener.offer({}, "x", wait_s=0.2) == "no standby connected within 0 s"
    assert not Path(restart_marker(str(tmp_path / "w.sock"))).exists()


def test_a_standby_whose_server_exits_without_offering_gets_nothing(tmp_path):
    listener = handover.Listener(str(tmp_path / "w.sock"))
    offer = handover.connect(str(tmp_path / "w.sock"))
    listener.close()  # as a process that ends before its offer (killed, or a left-behind engine's early exit)
    assert handover.receive(offer, wait_s=5) is None
    assert handover.connect(str(tmp_path / "missing.sock")) is None


def test_tensors_that_do_not_fit_the_model_built_now_are_refused_before_any_copy(make_engine, tmp_path):
    from tsdev_runtime.weights.layout import named_tensors

    engine = make_engine()
    tensors = {name: t.clone() for name, t in named_tensors(engine.runner.model).items()}
    tensors.pop(next(iter(tensors)))
    with pytest.raises(ValueError, match="do not fit"):
        loader.adopt_weights(engine.runner.model, tensors)


def test_tensors_are_offered_one_by_one_where_there_is_no_room_to_pack_them(make_engine, tmp_path, monkeypatch):
    old = make_engine()
    expected = greedy(old)
    monkeypatch.setattr(handover, "pack", lambda tensors: None)  # (a device without room for a second copy)
    outcome, received = hand_over(old, tmp_path / "w.sock")
    assert received is not None and "one by one" in outcome
    handover.hold(received)
    new = make_engine()
    assert new.runner.load_report.format == "handed over" and greedy(new) == expected


def test_packing_keeps_every_tensors_dtype_shape_and_values():
    import torch

    tensors = {"w": torch.randn(5, 7, dtype=torch.bfloat16), "t": torch.randn(6, 3).t(),  # not contiguous
               "s": torch.tensor(2.5), "e": torch.empty(0, 4), "q": torch.randn(3, 4).to(torch.float8_e4m3fn),
               "i": torch.arange(9, dtype=torch.int64)}
    packed = handover.pack(tensors)
    assert packed["packed"].dtype == torch.uint8 and packed["packed"].dim() == 1
    for name, tensor in tensors.items():
        got = handover._unpacked(packed["packed"], packed["places"][name])
        assert got.dtype == tensor.dtype and got.shape == tensor.shape
        assert torch.equal(got.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else got,
                           tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor)
        assert not got.numel() or (got.data_ptr() - packed["packed"].data_ptr()) % handover.PACK_ALIGN == 0
    assert handover.pack({"a": torch.zeros(2), "b": torch.zeros(2, device="meta")}) is None  # two devices


def test_a_gpu_without_room_for_the_packed_copy_and_the_standbys_offers_the_tensors_one_by_one(monkeypatch):
    """Packing holds a second copy on the stopping server's GPU while the standby makes its own: three copies of the
    weights at once where one by one needs two. A large model must not lose its hand-over to the packing."""
    import torch

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * gib))
    cuda = torch.device("cuda", 0)
    free = 70 * gib
    assert handover.room_for_two_copies(cuda, 30 * gib)
    free = 50 * gib  # a 30 GiB model's server after freeing its pool: the standby's copy fits, both do not
    assert not handover.room_for_two_copies(cuda, 30 * gib)
    assert handover.room_for_two_copies(torch.device("cpu"), 30 * gib)

"""Issue 16 (1-3): the checkpoint layout recorded at cold start, direct/full weight updates, weight checksums."""
import shutil
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file

import tsdev_runtime.weights.loader as loader
from tsdev_runtime.config import EngineConfig
from tsdev_runtime.control_protocol import ErrorBody, ReloadWeightsReply, WeightsChecksumReply
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.engine.sleep import overall_digest
from tsdev_runtime.engine.weights_drill import fresh_checksum
from tsdev_runtime.server.app import build_app
from tsdev_runtime.server.security import SecurityPolicy

UPDATE = "/v1/rl/engine/update_weights"
CHECKSUM = "/v1/rl/engine/weights_checksum"
COMPLETION = {"prompt": [1, 2, 3, 4, 5], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
              "return_token_ids": True}


def config(model_dir, **overrides) -> EngineConfig:
    return EngineConfig(**{**dict(model=str(model_dir), device="cpu", max_model_len=128, kv_pages=64,
                                  max_batched_tokens=128, max_running=8), **overrides})


def perturbed_copy(source: Path, target: Path, change=None) -> Path:
    """A copy of the checkpoint at `source` with every tensor perturbed deterministically (or changed by `change`)."""
    shutil.copytree(source, target)
    tensors = load_file(str(source / "model.safetensors"))
    generator = torch.Generator().manual_seed(16)
    out = {}
    for name, t in sorted(tensors.items()):
        noise = torch.randn(t.shape, generator=generator, dtype=torch.float32) * 0.05
        out[name] = (t.float() + noise).to(t.dtype) if change is None else change(name, t)
    save_file(out, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir, tmp_path_factory):
    allowed = tmp_path_factory.mktemp("allowed")
    b = perturbed_copy(tiny_model_dir, allowed / "B")

    def wrong_shape(name, t):
        return torch.cat([t, t[:1]]) if name.endswith("q_proj.weight") else t

    c = perturbed_copy(tiny_model_dir, allowed / "C", wrong_shape)
    return allowed, b, c


@pytest.fixture(scope="module")
def served(tiny_model_dir, checkpoints):
    allowed = checkpoints[0]
    engine = LLMEngine(config(tiny_model_dir))
    with TestClient(build_app(engine, "tiny", security=SecurityPolicy(allowed_weight_dirs=(allowed,)))) as client:
        yield client, engine


def greedy_ids(client) -> list[int]:
    response = client.post("/v1/completions", json=COMPLETION)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def checksum(client) -> WeightsChecksumReply:
    response = client.get(CHECKSUM)
    assert response.status_code == 200, response.text
    return WeightsChecksumReply.model_validate(response.json())


def refused(response, status: int, needle: str):
    assert response.status_code == status, response.text
    error = ErrorBody.model_validate_json(response.content).error
    assert needle in error.message, error.message
    return error


def addresses(engine) -> dict[str, int]:
    model = engine.runner.model
    return {n: t.data_ptr() for n, t in [*model.named_parameters(), *model.named_buffers()]}


@pytest.mark.slow
def test_direct_update_to_b_equals_a_fresh_server_on_b_and_back_to_a_equals_the_original(served, checkpoints,
                                                                                             tiny_model_dir):
    client, engine = served
    _, b, _ = checkpoints
    original_ids, original = greedy_ids(client), checksum(client)
    assert original.tensors == fresh_checksum(config(tiny_model_dir))
    assert original.overall == overall_digest(original.tensors)
    assert not any("cos_sin" in n for n in original.tensors)  # derived buffers are not part of it
    before = addresses(engine)
    reply = client.post(UPDATE, json={"path": str(b), "mode": "direct", "id": "step-1"})
    assert reply.status_code == 200, reply.text
    update = ReloadWeightsReply.model_validate(reply.json())
    assert update.mode == "direct" and update.id == "step-1" and update.recapture_seconds == 0
    assert addresses(engine) == before  # in place: graphs keep their pointers
    on_b = checksum(client)
    assert on_b.tensors == fresh_checksum(config(b)) and on_b.overall != original.overall
    with TestClient(build_app(LLMEngine(config(b)), "tiny")) as fresh_b:  # a fresh server on B
        assert greedy_ids(client) == greedy_ids(fresh_b) != original_ids
    # SGLang's route and body: back to A
    reply = client.post("/update_weights_from_disk", json={"model_path": str(tiny_model_dir)})
    assert reply.status_code == 200 and reply.json()["success"] is True, reply.text
    back = checksum(client)
    assert back.tensors == original.tensors and back.overall == original.overall
    assert greedy_ids(client) == original_ids and addresses(engine) == before


def test_a_refused_update_changes_nothing(served, checkpoints, tmp_path):
    client, engine = served
    _, _, c = checkpoints
    ids, sums, before = greedy_ids(client), checksum(client).tensors, addresses(engine)
    refused(client.post(UPDATE, json={"path": str(c)}), 400, "shape")
    refused(client.post(UPDATE, json={"path": str(tmp_path)}), 400, "--allowed-weight-dir")
    refused(client.post(UPDATE, json={"path": str(c), "mode": "partial"}), 400, "mode")
    assert checksum(client).tensors == sums and greedy_ids(client) == ids and addresses(engine) == before


def test_steps_are_refused_between_begin_and_finish_until_a_full_update_repairs_it(served, checkpoints, monkeypatch,
                                                                                   tiny_model_dir):
    client, engine = served
    _, b, _ = checkpoints
    ids, sums = greedy_ids(client), checksum(client).tensors
    real = loader._plain_tensors

    def dies_midway(entries):
        for n, item in enumerate(real(entries)):
            if n == len(entries) // 2:
                raise OSError("disk went away")
            yield item

    monkeypatch.setattr(loader, "_plain_tensors", dies_midway)
    error = refused(client.post(UPDATE, json={"path": str(b)}), 500, "disk went away")
    assert '"mode": "full"' in error.message  # the reply says what repairs it
    monkeypatch.undo()
    error = refused(client.post("/v1/completions", json=COMPLETION), 503, "update_weights")
    assert error.type == "server_error" and "full" in error.message
    assert client.get("/is_sleeping").json()["weights_loaded"] is False
    reply = client.post(UPDATE, json={"path": str(tiny_model_dir), "mode": "full", "id": "repair"})
    assert reply.status_code == 200, reply.text
    assert ReloadWeightsReply.model_validate(reply.json()).mode == "full"
    assert client.get("/is_sleeping").json()["weights_loaded"] is True
    assert greedy_ids(client) == ids and checksum(client).tensors == sums


def test_a_post_load_hook_that_replaces_a_parameter_is_refused_at_start(tiny_model_dir, monkeypatch):
    from torch import nn

    from tsdev_runtime.layers.norm import RMSNorm

    def replaces(self):
        self.weight = nn.Parameter(self.weight.detach().clone())

    monkeypatch.setattr(RMSNorm, "process_weights_after_loading", replaces, raising=False)
    with pytest.raises(RuntimeError, match="replaced .*norm.weight.*update in place instead"):
        LLMEngine(config(tiny_model_dir))


def test_direct_update_views_re_laid_out_tensors_back_in_the_same_storage(tiny_model_dir, checkpoints):
    """A hook that re-lays a tensor out (a transposed view of the same storage) is viewed back before the load."""
    from tsdev_runtime.weights import layout

    engine = LLMEngine(config(tiny_model_dir))
    model = engine.runner.model
    name, param = next((n, p) for n, p in model.named_parameters() if n.endswith("o_proj.weight"))
    address, shape = param.data_ptr(), tuple(param.shape)
    param.data = param.data.t()  # re-laid out, same storage
    assert engine.runner.weights.prepare_update(checkpoints[1]) == 1
    assert tuple(param.shape) == shape and param.is_contiguous() and param.data_ptr() == address
    param.data = torch.empty(0)  # a storage that cannot hold it: refused before anything changes
    with pytest.raises(layout.LayoutRefused, match=name):
        engine.runner.weights.prepare_update(checkpoints[1])


@pytest.mark.slow
def test_cli_update_and_verify_against_a_live_server(tiny_model_dir, checkpoints, tmp_path):
    from typer.testing import CliRunner

    from serve_process import serve
    from tsdev.cli import app

    allowed, b, _ = checkpoints
    args = [str(tiny_model_dir), "--device", "cpu", "--max-model-len", "256", "--served-model-name", "tiny",
            "--allowed-weight-dir", str(allowed)]
    with serve(args, tmp_path / "serve.log") as url:
        def run(*argv):
            return CliRunner().invoke(app, [*argv, "--url", url])

        result = run("weights", "verify", "--against", str(tiny_model_dir))
        assert result.exit_code == 0 and "identical" in result.output, result.output
        result = run("weights", "update", str(b))
        assert result.exit_code == 0 and "updated (direct)" in result.output, result.output
        result = run("weights", "verify", "--against", str(tiny_model_dir))
        assert result.exit_code == 1 and "DIFFERENT" in result.output and "qkv_proj" in result.output, result.output
        result = run("weights", "verify", "--against", str(b))
        assert result.exit_code == 0, result.output
        result = run("weights", "update", str(tiny_model_dir), "--mode", "full", "--id", "back")
        assert result.exit_code == 0 and "updated (full)" in result.output, result.output
        result = run("weights", "update", str(b), "--mode", "sideways")
        assert result.exit_code == 2


@pytest.mark.slow
def test_fp8_direct_update_refreshes_the_derived_tensors_in_place(tiny_model_dir, checkpoints):
    _, b, _ = checkpoints
    engine = LLMEngine(config(tiny_model_dir, quantization="fp8"))
    before = addresses(engine)
    engine.control.load_weights(b, "direct")
    fresh = LLMEngine(config(b, quantization="fp8"))
    assert any("weight_scale" in n for n in engine.control.checksum())
    assert engine.control.checksum() == fresh.control.checksum()  # fp8 values and scales, rotary table included
    assert addresses(engine) == before


def test_a_model_rebuilt_after_an_update_loads_the_updated_weights_not_the_served_models(tiny_model_dir, checkpoints):
    """A layer edit rebuilds the model from the checkpoint its weights last came from (reload_forward's rebuild)."""
    engine = LLMEngine(config(tiny_model_dir))
    original = engine.control.checksum(derived=False)
    engine.control.load_weights(checkpoints[1], "direct")
    updated = engine.control.checksum(derived=False)
    assert updated != original and engine.control.weights_dir == checkpoints[1]
    old = engine.control.ranked.rebuild_model(engine.control.weights_dir)
    assert engine.runner.model is not old and engine.control.checksum(derived=False) == updated
    engine.control.ranked.restore_model(old)
    assert engine.runner.model is old.model

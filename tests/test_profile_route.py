"""/start_profile with the TORCH activity on CPU: a trace per range, closed after N engine steps, written under
the server's --profile-dir (tests/test_security.py tries to write elsewhere)."""
import json

import httpx

from tsdev_runtime.control_protocol import ProfileRange, ProfileRequest
from tsdev.client import body


def test_torch_range_closes_after_n_steps_and_writes_a_trace(tiny_server, tiny_server_profile_dir):
    r = httpx.post(tiny_server + "/start_profile", json=body(ProfileRequest(activities=["TORCH"], num_steps=3,
                                                                            name="reload-1")))
    assert r.status_code == 200, r.text
    started = ProfileRange.model_validate_json(r.content)
    assert started.name == "reload-1" and started.num_steps == 3
    again = httpx.post(tiny_server + "/start_profile", json=body(ProfileRequest(activities=["TORCH"], num_steps=3)))
    assert again.status_code == 409 and "still open" in again.json()["error"]["message"]
    trace = tiny_server_profile_dir / "reload-1.trace.json"
    assert not trace.exists()
    httpx.post(tiny_server + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 8, "ignore_eos": True},
               timeout=30)
    assert trace.exists()
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("aten::" in e.get("name", "") for e in events)
    # closed: a new range can open (output_dir: a subdirectory of the profile directory), /stop_profile closes it early
    assert httpx.post(tiny_server + "/start_profile", json=body(ProfileRequest(
        activities=["TORCH"], num_steps=1000, output_dir="early"))).status_code == 200
    stopped = ProfileRange.model_validate_json(httpx.post(tiny_server + "/stop_profile").content)
    assert stopped.steps == 0 and stopped.trace
    assert (tiny_server_profile_dir / "early" / f"{stopped.name}.trace.json").exists()


def test_bad_profile_requests_are_refused(tiny_server):
    r = httpx.post(tiny_server + "/start_profile", json={"activities": ["CUDA_PROFILER"], "num_steps": 2})
    assert r.status_code == 400 and "CUDA device" in r.json()["error"]["message"]
    assert httpx.post(tiny_server + "/start_profile", json={"activities": ["NOPE"]}).status_code == 400
    assert httpx.post(tiny_server + "/stop_profile").status_code == 400


def test_a_trace_that_cannot_be_written_is_reported_not_raised_in_the_engine_step(tmp_path):
    import torch

    from tsdev_runtime.engine.profiler import StepProfiler

    profiler = StepProfiler(torch.device("cpu"), tmp_path)
    profiler.start(["TORCH"], 1, output_dir=str(tmp_path / "out"), name="r")
    (tmp_path / "out").write_text("a file where the folder should be")  # the write will fail
    closed = profiler.after_step()  # runs inside the engine step: must not raise
    assert closed is not None and closed.trace is None and "could not write the trace" in closed.error
    assert profiler.active is None  # a new range can open

"""/start_profile with the TORCH activity on CPU: a trace per range, closed after N engine steps."""
import json

import httpx

from runtime.control_protocol import ProfileRange, ProfileRequest
from tsdev.client import body


def test_torch_range_closes_after_n_steps_and_writes_a_trace(tiny_server, tmp_path):
    r = httpx.post(tiny_server + "/start_profile", json=body(ProfileRequest(activities=["TORCH"], num_steps=3,
                                                                            output_dir=str(tmp_path), name="reload-1")))
    assert r.status_code == 200, r.text
    started = ProfileRange.model_validate_json(r.content)
    assert started.name == "reload-1" and started.num_steps == 3
    again = httpx.post(tiny_server + "/start_profile", json=body(ProfileRequest(activities=["TORCH"], num_steps=3)))
    assert again.status_code == 409 and "still open" in again.json()["error"]["message"]
    trace = tmp_path / "reload-1.trace.json"
    assert not trace.exists()
    httpx.post(tiny_server + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 8, "ignore_eos": True}, timeout=30)
    assert trace.exists()
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("aten::" in e.get("name", "") for e in events)
    # closed: a new range can open, and /stop_profile closes it early
    assert httpx.post(tiny_server + "/start_profile", json=body(ProfileRequest(
        activities=["TORCH"], num_steps=1000, output_dir=str(tmp_path)))).status_code == 200
    stopped = ProfileRange.model_validate_json(httpx.post(tiny_server + "/stop_profile").content)
    assert stopped.steps == 0 and stopped.trace and (tmp_path / f"{stopped.name}.trace.json").exists()


def test_bad_profile_requests_are_refused(tiny_server):
    r = httpx.post(tiny_server + "/start_profile", json={"activities": ["CUDA_PROFILER"], "num_steps": 2})
    assert r.status_code == 400 and "CUDA device" in r.json()["error"]["message"]
    assert httpx.post(tiny_server + "/start_profile", json={"activities": ["NOPE"]}).status_code == 400
    assert httpx.post(tiny_server + "/stop_profile").status_code == 400

"""`tsdev serve --dp 2`: two replicas behind one front; requests spread over both, a reload reaches both, metrics
carry a replica label."""
import pytest
import threading

import httpx

from tsdev_runtime.control_protocol import ReloadReply, WorkerReport
from serve_process import copy_project, serve
from test_reload_forward import ACTIVATION, SILU_LINE, complete, edited, new_id, reload
from tsdev.launch.data_parallel import build_front, merge_metrics, merge_reloads, replica_args, replica_log

pytestmark = pytest.mark.slow  # spawns servers or rank processes (pytest -m 'not slow': the quick loop)


def test_a_replica_gets_the_fronts_flags_without_the_address_and_the_data_parallelism():
    args = ["M", "--dp", "2", "--port", "9000", "--host=0.0.0.0", "--tp", "2", "--data-parallel-size=2", "--seed", "3"]
    assert replica_args(args) == ["M", "--tp", "2", "--seed", "3"]


def test_reload_replies_merge_with_ranks_numbered_across_replicas():
    a = ReloadReply.of("r", [WorkerReport(rank=0, ok=True), WorkerReport(rank=1, ok=True)])
    b = ReloadReply.of("r", [WorkerReport(rank=0, ok=True), WorkerReport(rank=1, ok=False, error="boom")])
    merged = merge_reloads([a, b], tp=2)
    assert [w.rank for w in merged.workers] == [0, 1, 2, 3] and not merged.ok and merged.first_failure.rank == 3


def test_metrics_of_the_replicas_are_labelled_by_replica():
    text = ('# HELP tsdev_requests_total Requests.\n# TYPE tsdev_requests_total counter\n'
            'tsdev_requests_total{model="m"} 3.0\n')
    merged = merge_metrics([text, text.replace("3.0", "5.0")]).decode()
    assert 'tsdev_requests_total{model="m",replica="0"} 3.0' in merged
    assert 'tsdev_requests_total{model="m",replica="1"} 5.0' in merged


def test_two_replicas_share_concurrent_requests_and_a_reload_reaches_both(tiny_model_dir, tmp_path):
    """And the front's output is the front's: `starting tsdev serve` once, one `listening on` line (the front's
    address, which a script waits for) after the replicas' addresses; each replica's output is in its own log."""
    project = copy_project(tmp_path / "project")
    args = [str(tiny_model_dir), "--device", "cpu", "--max-model-len", "1024", "--cudagraph-capture-sizes", "1",
            "--allow-reload-forward", "--dp", "2"]
    with serve(args, tmp_path / "dp.log", cwd=project, timeout=180) as url:
        front = (tmp_path / "dp.log").read_text().splitlines()
        listening = [i for i, line in enumerate(front) if "listening on" in line]
        assert len(listening) == 1 and front[listening[0]].startswith(f"listening on {url} "), front
        assert sum(line.startswith("starting tsdev serve") for line in front) == 1, front
        assert front[listening[0] - 1].startswith("2 replicas at "), front
        port = int(url.rsplit(":", 1)[1])
        for replica in range(2):
            assert "listening on http://127.0.0.1:" in replica_log(port, replica).read_text()
        expected = complete(url)["text"]
        results = []
        threads = [threading.Thread(target=lambda: results.append(complete(url, max_tokens=64)["text"]))
                   for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(results) == 6
        metrics = httpx.get(url + "/metrics").text
        served = {line.split('replica="')[1][0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if line.startswith("tsdev_generation_tokens_total{")}
        assert set(served) == {"0", "1"} and all(v > 0 for v in served.values()), metrics
        with edited(project, ACTIVATION, SILU_LINE, "    return -F.silu(gate) * up\n"):
            reply = reload(url, new_id())
            assert reply.ok and [w.rank for w in reply.workers] == [0, 1], reply
            assert all(w.reloaded == ["tsdev_kernels.ops.activation"] for w in reply.workers)
            edited_texts = {complete(url)["text"] for _ in range(4)}  # whichever replica answers: the edit
            assert edited_texts != {expected} and len(edited_texts) == 1
        assert reload(url, new_id()).ok
        assert complete(url)["text"] == expected


def test_the_front_relays_generation_to_one_replica_and_control_calls_to_all_of_them():
    import json

    import httpx
    from fastapi.testclient import TestClient

    from tsdev_runtime.control_protocol import PAUSE_ROUTE

    seen, down = [], set()

    def replica(request: httpx.Request) -> httpx.Response:  # streamed, as a server's reply is relayed
        seen.append((request.url.host, request.url.path))
        status, body = (503, {"status": "down"}) if request.url.host in down else (
            200, {"from": request.url.host, "path": request.url.path})
        return httpx.Response(status, headers={"content-type": "application/json"},
                              stream=httpx.ByteStream(json.dumps(body).encode()))

    client = httpx.AsyncClient(transport=httpx.MockTransport(replica))
    with TestClient(build_front(["http://a", "http://b"], tp=1, client=client)) as front:
        reply = front.post("/v1/completions", json={"prompt": "hi"})
        assert reply.json() == {"from": "a", "path": "/v1/completions"}  # none outstanding: the first replica
        seen.clear()
        assert front.post(PAUSE_ROUTE, json={}).status_code == 200
        assert sorted(seen) == [("a", PAUSE_ROUTE), ("b", PAUSE_ROUTE)]  # a control call reaches every replica
        assert front.get("/health").json() == {"status": "ok", "replicas": 2}
        assert front.get("/v1/models").json() == {"from": "a", "path": "/v1/models"}  # replica 0's, relayed
        down.add("b")
        reply = front.get("/health")
        assert reply.status_code == 503 and reply.json()["replicas_down"] == [1]

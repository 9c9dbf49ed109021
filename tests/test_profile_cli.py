"""tsdev profile without nsys (CPU): a torch trace and a summary per range."""
import pytest
import csv
import json
import os
import subprocess
import sys
import time

from tsdev.client import reload_forward
from tsdev.profile import KernelRow, find_nsys, parse_kernel_csv, torch_trace_summary, write_summary
from tsdev.launch.child import free_port

pytestmark = pytest.mark.slow  # spawns servers or rank processes (pytest -m 'not slow': the quick loop)


def test_profile_without_nsys_takes_a_torch_range_per_reload_and_summarises_it(tiny_model_dir, tmp_path):
    """With an API key (TSDEV_API_KEY): the server profile starts requires it, and profile sends it."""
    env = {**os.environ, "PATH": "/usr/bin:/bin", "NSYS": str(tmp_path / "missing-nsys"), "TSDEV_API_KEY": "prof-key"}
    out, port = tmp_path / "prof", free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tsdev", "profile", str(tiny_model_dir), "--device", "cpu",
                             "--max-model-len", "512", "--out", str(out), "--ranges", "2", "--num-steps", "4",
                             "--port", str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while not (out / "reload-0.summary.md").exists():
            assert proc.poll() is None and time.monotonic() < deadline, (
                proc.stdout.read() if proc.poll() is not None else "timeout")
            time.sleep(0.5)
        reply = reload_forward(f"http://127.0.0.1:{port}", ["tsdev_runtime.layers.activation"], timeout_s=120,
                               api_key="prof-key")
        assert reply.ok, reply
        stdout, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stdout
    assert "nsys not found" in stdout and "missing-nsys" in stdout
    # torch's profiler started first on the main thread: kineto's "ERROR: External init callback must run in same
    # thread as registerClient" (a first start on the engine thread) is not shown
    assert "registerClient" not in stdout and "ERROR" not in stdout, stdout
    for name in ("reload-0", "reload-1"):
        assert (out / f"{name}.trace.json").exists()
        summary = (out / f"{name}.summary.md").read_text()
        assert "aten::" in summary and "| CPU op | self CPU time (ms) |" in summary and "GPU" not in summary
        assert "| tsdev:forward |" in summary and "| tsdev:sample |" in summary  # the step table
        rows = list(csv.DictReader(open(out / f"{name}.summary.csv")))
        assert {r["kind"] for r in rows} == {"cpu_op", "nvtx"}
        steps = {r["name"]: r for r in rows if r["kind"] == "nvtx"}
        assert {"tsdev:schedule", "tsdev:prepare", "tsdev:forward", "tsdev:sample"} <= set(steps)
        assert int(steps["tsdev:forward"]["instances"]) >= 4
        # self times: each operator's time counted once, so they fit in the traced wall time
        events = [e for e in json.loads((out / f"{name}.trace.json").read_text())["traceEvents"]
                  if e.get("cat") == "cpu_op"]
        wall_ms = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / 1e3
        self_ms = sum(float(r["total_ms"]) for r in rows if r["kind"] == "cpu_op")
        assert 0 < self_ms <= wall_ms * 1.001, (self_ms, wall_ms)
        assert self_ms < sum(e["dur"] for e in events) / 1e3  # nested operators are not counted twice
    assert "vs previous" in (out / "reload-1.summary.md").read_text()


def trace(path, events):
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "pid": 1, "tid": 1, **e} for e in events]}))
    return path


def test_cpu_trace_rows_are_operators_by_self_time(tmp_path):
    """aten::linear (10 us) runs aten::addmm (7 us), which runs aten::copy_ (2 us); another thread runs
    aten::mul. Self times: 3, 5, 2 and 4 us; the step ranges are listed, and count in no operator."""
    path = trace(tmp_path / "t.json", [
        {"cat": "user_annotation", "name": "tsdev:forward", "ts": 99.0, "dur": 13.0},
        {"cat": "cpu_op", "name": "aten::linear", "ts": 100.0, "dur": 10.0},
        {"cat": "cpu_op", "name": "aten::addmm", "ts": 101.0, "dur": 7.0},
        {"cat": "cpu_op", "name": "aten::copy_", "ts": 102.0, "dur": 2.0},
        {"cat": "cpu_op", "name": "aten::mul", "ts": 103.0, "dur": 4.0, "tid": 2},
        {"cat": "user_annotation", "name": "tsdev:sample", "ts": 112.5, "dur": 0.5},
        {"cat": "user_annotation", "name": "other", "ts": 112.5, "dur": 0.5},
    ])
    summary = torch_trace_summary(path)
    assert not summary.on_gpu
    assert {r.name: r.total_ns for r in summary.rows} == {"aten::addmm": 5e3, "aten::mul": 4e3,
                                                          "aten::linear": 3e3, "aten::copy_": 2e3}
    assert [(r.name, r.total_ns, r.instances) for r in summary.steps] == [("tsdev:forward", 13e3, 1),
                                                                          ("tsdev:sample", 500.0, 1)]
    md = write_summary(tmp_path / "reload-0", summary.rows, summary.steps, None, cpu=True)
    assert "| CPU op | self CPU time (ms) | share | calls |" in md and "| `aten::addmm` | 0.005 | 36% |" in md
    assert "| tsdev:forward | 0.013 |" in md and "GPU" not in md and "kernel" not in md
    csv_rows = (tmp_path / "reload-0.summary.csv").read_text().splitlines()
    assert csv_rows[1].startswith("cpu_op,aten::addmm,0.0050,1,5.000") and csv_rows[-1].startswith("nvtx,tsdev:sample")


def test_gpu_trace_rows_are_kernels_by_gpu_time(tmp_path):
    path = trace(tmp_path / "t.json", [
        {"cat": "cpu_op", "name": "aten::mm", "ts": 100.0, "dur": 10.0},
        {"cat": "kernel", "name": "gemm", "ts": 105.0, "dur": 3.0, "tid": 7},
        {"cat": "kernel", "name": "gemm", "ts": 109.0, "dur": 5.0, "tid": 7},
        {"cat": "user_annotation", "name": "tsdev:forward", "ts": 99.0, "dur": 12.0},
    ])
    summary = torch_trace_summary(path)
    assert summary.on_gpu and [(r.name, r.total_ns, r.instances) for r in summary.rows] == [("gemm", 8e3, 2)]
    assert [r.name for r in summary.steps] == ["tsdev:forward"]
    md = write_summary(tmp_path / "reload-0", summary.rows, summary.steps, None)
    assert "| kernel | GPU time (ms) |" in md and "| tsdev:forward |" in md


def test_find_nsys_honours_the_env_variable(tmp_path, monkeypatch):
    fake = tmp_path / "nsys"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("NSYS", str(fake))
    assert find_nsys()[0] == str(fake)


def test_summary_compares_against_the_previous_range(tmp_path):
    before = [KernelRow("rms_norm_kernel", 2e6, 100, 2e4), KernelRow("gone", 1e6, 10, 1e5)]
    after = [KernelRow("rms_norm_kernel", 1e6, 100, 1e4), KernelRow("silu_and_mul_kernel", 3e6, 100, 3e4)]
    md = write_summary(tmp_path / "reload-2", after, [], before)
    assert "-50.0%" in md and "new" in md
    rows = (tmp_path / "reload-2.summary.csv").read_text().splitlines()
    assert rows[1].startswith("kernel,rms_norm_kernel,1.0000,100,10.000,2.0000,-50.0%")


def test_kernel_csv_parser_skips_notices_before_the_header():
    text = ('Processing [x.sqlite] with [cuda_gpu_kern_sum.py]...\n'
            '"Time (%)","Total Time (ns)","Instances","Avg (ns)","Med (ns)","Min (ns)","Max (ns)",'
            '"StdDev (ns)","Name"\n'
            '60.0,600,3,200.0,200.0,100,300,100.0,"small_kernel"\n'
            '40.0,900,1,900.0,900.0,900,900,0.0,"big_kernel"\n')
    rows = parse_kernel_csv(text)
    assert [r.name for r in rows] == ["big_kernel", "small_kernel"] and rows[1].instances == 3


def test_parsers_read_real_nsys_stats_output():
    """Fixtures: `nsys stats` CSVs of a real `tsdev profile` range on the H200 (tests/test_profile_gpu.py)."""
    from pathlib import Path

    from tsdev.profile import parse_nvtx_csv

    fixtures = Path(__file__).parent / "fixtures"
    kernels = parse_kernel_csv((fixtures / "nsys_cuda_gpu_kern_sum.csv").read_text())
    names = [k.name for k in kernels]
    assert {"_decode_kernel", "_rms_norm_kernel", "_silu_and_mul_kernel"} <= set(names)
    assert kernels[0].total_ns >= kernels[-1].total_ns and kernels[0].instances > 0
    decode = next(k for k in kernels if k.name == "_decode_kernel")
    assert (decode.total_ns, decode.instances) == (960134.0, 224)
    nvtx = {r.name: r for r in parse_nvtx_csv((fixtures / "nsys_nvtx_sum.csv").read_text())}
    assert set(nvtx) == {"tsdev:forward", "tsdev:sample", "tsdev:prepare", "tsdev:schedule"}
    assert nvtx["tsdev:forward"].instances == 10

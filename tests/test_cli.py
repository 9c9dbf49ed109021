from typer.testing import CliRunner

from tsdev.cli import app


def test_serve_help_explains_the_flags():
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for flag in ("--device", "--host", "--port", "--max-running", "--kv-pages", "--max-model-len", "--page-size"):
        assert flag in result.output
    assert "127.0.0.1" in result.output


def test_serve_reports_a_bad_model_dir_and_exits_2(tmp_path):
    result = CliRunner().invoke(app, ["serve", str(tmp_path), "--device", "cpu"])
    assert result.exit_code == 2
    assert "no config.json" in result.output


def test_serve_refuses_an_unknown_tsdev_kernels_value(tiny_model_dir, monkeypatch):
    import uvicorn

    monkeypatch.setenv("TSDEV_KERNELS", "ref:gemm")
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: print("served despite the bad value"))
    result = CliRunner().invoke(app, ["serve", str(tiny_model_dir), "--device", "cpu"])
    assert result.exit_code == 2
    assert "TSDEV_KERNELS='ref:gemm'" in result.output and "linear" in result.output


def test_serve_on_cuda_without_a_gpu_says_so(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = CliRunner().invoke(app, ["serve", "--device", "cuda"])
    assert result.exit_code == 2 and "sees no CUDA GPU" in result.output


def test_serve_banner_names_the_graphs_and_the_startup_phases(make_engine):
    from tsdev.cli import _describe_graphs, _describe_startup

    engine = make_engine(cudagraph_capture_sizes=[1, 4], max_batched_tokens=64)
    graphs = _describe_graphs(engine.describe(), False, engine.startup_timings)
    assert graphs.startswith("2 decode graph(s) prepared") and "4 prefill graph(s) (16..64 tokens)" in graphs
    startup = _describe_startup(1.5, engine.startup_timings)
    assert startup.startswith("startup: imports 1.50 s, load ") and "warm-up" in startup and "prefill" in startup
    assert _describe_graphs(make_engine(enforce_eager=True).describe(), False, {}) == "CUDA graphs off"

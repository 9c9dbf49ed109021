"""A bad `tsdev serve` flag (or the same flag given to `tsdev watch`) is refused before anything imports torch, binds
or loads: one line that names the flag and what it takes, exit status 2. A model name that is neither a directory nor
an embedded model names the embedded ones, and the nearest."""
import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from tsdev.cli import app

# flag values that crashed in the engine (a traceback, exit status 1) or were quietly taken for something else
BAD = {
    "max-model-len -5": (["--max-model-len", "-5"], "--max-model-len must be at least 2 (got -5)"),
    "max-model-len 1": (["--max-model-len", "1"], "--max-model-len must be at least 2 (got 1)"),
    "max-model-len 0": (["--max-model-len", "0"], "--max-model-len must be at least 2 (got 0)"),
    "max-batched-tokens 0": (["--max-batched-tokens", "0"], "--max-batched-tokens / --max-num-batched-tokens "
                                                             "must be at least 1 (got 0)"),
    "page-size 0": (["--page-size", "0"], "--page-size / --block-size must be at least 1 (got 0)"),
    "port 99999": (["--port", "99999"], "--port must be from 0 to 65535 (got 99999)"),
    "max-running 0": (["--max-num-seqs", "0"], "--max-running / --max-num-seqs must be at least 1 (got 0)"),
    "kv-pages 0": (["--kv-pages", "0"], "--kv-pages / --num-gpu-blocks-override must be at least 1 (got 0)"),
    "tp 0": (["--tp", "0"], "--tp / --tensor-parallel-size must be at least 1 (got 0)"),
    "dp 0": (["--dp", "0"], "--dp / --data-parallel-size must be at least 1 (got 0)"),
    "gpu-memory-utilization 2": (["--gpu-memory-utilization", "2"], "--gpu-memory-utilization must be more than 0 "
                                                                    "and at most 1"),
    "rank-timeout 0": (["--rank-timeout", "0"], "--rank-timeout must be a number of seconds, at least 1"),
    "seed too large": (["--seed", str(2**64)], "--seed must be from 0 to 18446744073709551615"),
    "prefill-graph-max-tokens -1": (["--prefill-graph-max-tokens", "-1"], "--prefill-graph-max-tokens must be at "
                                                                          "least 0 (got -1)"),
    "max-request-body-bytes 0": (["--max-request-body-bytes", "0"], "--max-request-body-bytes must be at least 1"),
    "dtype": (["--dtype", "float8"], "--dtype must be one of auto, bfloat16, float16, float32 (got float8)"),
    "log-level": (["--log-level", "loud"], "--log-level must be one of critical, error, warning, info, debug, "
                                           "trace (got loud)"),
    "device": (["--device", "gpu"], "--device must be cpu, cuda or cuda:N (got gpu)"),
    "capture sizes": (["--cudagraph-capture-sizes", "0"], "--cudagraph-capture-sizes: give positive integers"),
    "pool under one sequence": (["--kv-pages", "2", "--max-model-len", "64"], "--kv-pages 2 of --page-size 16 hold "
                                                                              "32 tokens, fewer than one sequence"),
}


@pytest.fixture
def nothing_loads(monkeypatch):
    import tsdev.launch.serve

    def load(*args):
        raise AssertionError("serving started: the flag was not refused before anything loads")

    monkeypatch.setattr(tsdev.launch.serve, "run_server", load)


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_a_bad_serve_flag_is_one_line_naming_the_flag_and_its_range_with_status_2(case, nothing_loads):
    args, said = BAD[case]
    result = CliRunner().invoke(app, ["serve", *args])
    assert result.exit_code == 2, result.output
    assert result.output.splitlines() == [result.output.strip()] and result.output.startswith("error: ")
    assert said in result.output, result.output


def test_bad_serve_flags_are_refused_before_torch_is_imported():
    """In a fresh interpreter: the refusal comes before the seconds of importing torch."""
    cases = [args for args, _ in BAD.values()]
    script = ("import json, sys\nfrom typer.testing import CliRunner\nfrom tsdev.cli import app\n"
              f"codes = [CliRunner().invoke(app, ['serve', *args]).exit_code for args in {cases}]\n"
              "print(json.dumps([codes, 'torch' in sys.modules]))")
    codes, torch_imported = json.loads(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                                      check=True, timeout=120).stdout)
    assert codes == [2] * len(BAD) and not torch_imported


def test_watch_refuses_the_server_flags_it_passes_on_as_serve_does(monkeypatch):
    import tsdev.watch

    monkeypatch.setattr(tsdev.watch, "run", lambda *a, **k: pytest.fail("watch started despite the bad flag"))
    result = CliRunner().invoke(app, ["watch", "--no-tui", "--page-size", "0"])
    assert result.exit_code == 2 and result.output == "error: --page-size / --block-size must be at least 1 (got 0)\n"
    result = CliRunner().invoke(app, ["watch", "--no-tui", "--port", "many"])
    assert result.exit_code == 2 and result.output.startswith("error: Invalid value for '--port'")
    result = CliRunner().invoke(app, ["watch", "--no-tui", "--port", "0"])  # any free port: watch could not find it
    assert result.exit_code == 2 and result.output.startswith("error: --port 0 (any free port) leaves tsdev watch")
    started = []
    monkeypatch.setattr(tsdev.watch, "run", lambda config, tui: started.append(config) or 0)
    result = CliRunner().invoke(app, ["watch", "--no-tui", "M", "--page-size", "8", "--port", "8001"])
    assert result.exit_code == 0 and started[0].server_args == ["--page-size", "8", "--port", "8001"], result.output


EMBEDDED = "default, default-moe, default-fp8, default-moe-fp8, default-mla"


def test_a_model_that_is_no_directory_names_the_embedded_models_and_the_nearest(nothing_loads):
    result = CliRunner().invoke(app, ["serve", "--model", "default-nope", "--device", "cpu"])
    assert result.exit_code == 2
    assert "default-nope is neither a directory nor a model embedded in tsdev" in result.output
    assert EMBEDDED in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(app, ["serve", "default-mo", "--device", "cpu"])
    assert result.exit_code == 2 and "did you mean default-moe?" in result.output and EMBEDDED in result.output
    result = CliRunner().invoke(app, ["serve", "/no/such/checkpoint", "--device", "cpu"])
    assert result.exit_code == 2 and "did you mean" not in result.output


def test_the_engine_names_the_embedded_models_too():
    from tsdev_runtime.config import EngineConfig
    from tsdev_runtime.engine.model_runner import Checkpoint

    with pytest.raises(FileNotFoundError, match="did you mean default-mla"):
        Checkpoint.open(EngineConfig(model="default-ml", device="cpu"))


def test_default_names_the_embedded_default_model(monkeypatch):
    import tsdev.launch.serve

    seen = []
    monkeypatch.setattr(tsdev.launch.serve, "run_server",
                        lambda config, server, console, *_: seen.append((config, server)))
    result = CliRunner().invoke(app, ["serve", "default", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    config, server = seen[0]
    assert config.model == "default" and server.served_model_name == "default"

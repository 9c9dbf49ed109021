"""tsdev bench against a real server: metrics present, consistent, and recomputable from the raw timestamps."""
import pytest
import asyncio
import json
import statistics

from dataclasses import asdict

from typer.testing import CliRunner

from tsdev import bench, bench_report
from tsdev.bench import BenchConfig, run_bench
from tsdev.cli import app


def run(url, **kwargs):
    return asyncio.run(run_bench(BenchConfig(url=url, **kwargs)))


@pytest.mark.slow
def test_bench_counts_every_requested_token(tiny_server):
    result = run(tiny_server, num_prompts=12, input_len=40, output_len=9, max_concurrency=4, warmup=1)
    m = result["metrics"]
    assert m["successful_requests"] == 12 and m["failed_requests"] == 0
    assert m["output_tokens"] == 12 * 9 and m["input_tokens"] == 12 * 40
    assert all(len(r["chunk_times"]) >= 1 for r in result["records"])
    assert m["mean_ttft_ms"] <= m["mean_e2el_ms"] and m["median_ttft_ms"] <= m["p90_ttft_ms"] <= m["p99_ttft_ms"]
    assert abs(m["output_throughput"] - m["output_tokens"] / m["duration_s"]) < 1e-6


def test_metrics_match_an_independent_computation(tiny_server):
    result = run(tiny_server, num_prompts=10, input_len=20, output_len=12, range_ratio=0.5, request_rate=50, seed=3)
    m, records = result["metrics"], result["records"]
    ttft = [r["ttft"] * 1000 for r in records]
    e2e = [r["latency"] * 1000 for r in records]
    itl = [(b - a) * 1000 for r in records for a, b in zip(r["chunk_times"], r["chunk_times"][1:])]
    tpot = [(r["latency"] - r["ttft"]) * 1000 / (r["output_tokens"] - 1) for r in records if r["output_tokens"] > 1]
    assert abs(m["mean_ttft_ms"] - statistics.fmean(ttft)) < 1e-6
    assert abs(m["median_e2el_ms"] - statistics.median(e2e)) < 1e-6
    assert abs(m["p99_itl_ms"] - statistics.quantiles(itl, n=100, method="inclusive")[98]) < 1e-6
    assert abs(m["p90_tpot_ms"] - statistics.quantiles(tpot, n=10, method="inclusive")[8]) < 1e-6
    lengths = {r["output_tokens"] for r in records}
    assert len(lengths) > 1 and all(6 <= n <= 18 for n in lengths)  # range ratio 0.5 around 12


def test_failed_requests_are_counted_and_shown(tiny_server, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "hello", "max_tokens": 4}, {"prompt": "too long", "max_tokens": 5000}] * 3
    prompts.write_text("\n".join(json.dumps(line) for line in lines))
    result = run(tiny_server, num_prompts=6, prompts_file=str(prompts))
    m = result["metrics"]
    assert m["successful_requests"] == 3 and m["failed_requests"] == 3
    assert m["output_tokens"] == 12
    assert "maximum context length" in result["errors"][0]


def test_cli_prints_a_table_saves_and_compares(tiny_server, tmp_path):
    runner = CliRunner()
    out = tmp_path / "run.json"
    first = runner.invoke(app, ["bench", "--url", tiny_server, "--num-prompts", "4", "--input-len", "8",
                                "--output-len", "4", "--save-result", str(out)])
    assert first.exit_code == 0, first.output
    assert "Output token throughput" in first.output and json.loads(out.read_text())["metrics"]["output_tokens"] == 16
    second = runner.invoke(app, ["bench", "--base-url", tiny_server, "--num-prompts", "4", "--random-input-len", "8",
                                 "--random-output-len", "4", "--endpoint", "/v1/completions", "--baseline", str(out)])
    assert second.exit_code == 0, second.output  # vLLM's names for the same workload: comparable
    assert "baseline" in second.output and "%" in second.output


def test_cli_chat_endpoint_and_vllms_save_result_flag(tiny_server, tmp_path):
    result = CliRunner().invoke(app, ["bench", "--url", tiny_server, "--num-prompts", "3", "--random-input-len", "8",
                                      "--random-output-len", "3", "--endpoint", "/v1/chat/completions",
                                      "--save-result", "--result-dir", str(tmp_path), "--result-filename", "chat.json"])
    assert result.exit_code == 0, result.output
    saved = json.loads((tmp_path / "chat.json").read_text())
    assert saved["config"]["endpoint"] == "chat" and saved["metrics"]["output_tokens"] == 9


def test_chat_prompts_have_the_asked_tokens_with_the_templates_own_counted_in(tiny_server):
    result = run(tiny_server, endpoint="chat", num_prompts=6, input_len=32, output_len=2, seed=5)
    assert [r["prompt_tokens"] for r in result["records"]] == [32] * 6
    varied = run(tiny_server, endpoint="chat", num_prompts=6, input_len=40, output_len=2, range_ratio=0.5, seed=6)
    assert all(20 <= r["prompt_tokens"] <= 60 for r in varied["records"])
    assert len({r["prompt_tokens"] for r in varied["records"]}) > 1


def test_cli_refuses_bad_arguments_clearly(tmp_path):
    runner = CliRunner()
    bad = runner.invoke(app, ["bench", "--range-ratio", "1.5"])
    assert bad.exit_code == 2 and "--random-range-ratio must be in [0, 1)" in bad.output
    missing = runner.invoke(app, ["bench", "--prompts", str(tmp_path / "nope.jsonl")])
    assert missing.exit_code == 2 and "no such file" in missing.output
    down = runner.invoke(app, ["bench", "--url", "http://127.0.0.1:9", "--num-prompts", "1"])
    assert down.exit_code == 2 and "cannot reach" in down.output
    endpoint = runner.invoke(app, ["bench", "--endpoint", "/v1/embeddings"])
    assert endpoint.exit_code == 2 and "/v1/chat/completions" in endpoint.output
    jsonl = runner.invoke(app, ["bench", "--dataset-name", "jsonl"])
    assert jsonl.exit_code == 2 and "--dataset-path" in jsonl.output


def bench_config(monkeypatch, args) -> BenchConfig:
    """The BenchConfig `tsdev bench ARGS` runs (nothing is sent)."""
    seen = []

    async def fake_run(config, progress=None, api_key=None):
        seen.append(config)
        return {"model": "m", "config": asdict(config), "metrics": {"failed_requests": 0}, "errors": []}

    monkeypatch.setattr(bench, "run_bench", fake_run)
    monkeypatch.setattr(bench_report, "render", lambda result, before: "table")
    result = CliRunner().invoke(app, ["bench", *args])
    assert result.exit_code == 0, result.output
    return seen[0]


def test_vllm_bench_serve_flags_set_the_same_config_as_tsdevs(monkeypatch, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi", "max_tokens": 2}\n')
    common = ["--num-prompts", "7", "--request-rate", "3", "--max-concurrency", "2", "--seed", "5"]
    tsdev_random = bench_config(monkeypatch, [*common, "--endpoint", "chat", "--input-len", "64", "--output-len",
                                              "16", "--range-ratio", "0.25"])
    vllm_random = bench_config(monkeypatch, [*common, "--endpoint", "/v1/chat/completions", "--dataset-name", "random",
                                             "--random-input-len", "64", "--random-output-len", "16",
                                             "--random-range-ratio", "0.25"])
    assert vllm_random == tsdev_random
    assert (vllm_random.endpoint, vllm_random.dataset_name, vllm_random.input_len, vllm_random.num_prompts,
            vllm_random.max_concurrency) == ("chat", "random", 64, 7, 2)
    tsdev_jsonl = bench_config(monkeypatch, ["--prompts", str(prompts)])
    for vllm_name in ("jsonl", "custom"):
        vllm_jsonl = bench_config(monkeypatch, ["--dataset-name", vllm_name, "--dataset-path", str(prompts)])
        assert vllm_jsonl == tsdev_jsonl and vllm_jsonl.dataset_name == "jsonl"


def test_a_baseline_of_another_workload_is_refused(tmp_path):
    saved = tmp_path / "base.json"
    baseline = BenchConfig(endpoint="completions", num_prompts=20, input_len=256, output_len=128)
    saved.write_text(json.dumps({"model": "m", "config": asdict(baseline), "metrics": {}}))
    run = CliRunner().invoke(app, ["bench", "--url", "http://127.0.0.1:9", "--endpoint", "/v1/chat/completions",
                                   "--num-prompts", "20", "--random-input-len", "64", "--baseline", str(saved)])
    assert run.exit_code == 2, run.output
    assert "another workload" in run.output and "cannot reach" not in run.output  # refused before sending anything
    assert "--endpoint: chat in this run, completions in the baseline" in run.output
    assert "--random-input-len: 64 in this run, 256 in the baseline" in run.output
    assert "--num-prompts" not in run.output.split("baseline:")[-1]  # only what differs is listed
    assert "save a new baseline" in run.output
    same = CliRunner().invoke(app, ["bench", "--url", "http://127.0.0.1:9", "--num-prompts", "20",
                                    "--baseline", str(saved)])
    assert same.exit_code == 2 and "cannot reach" in same.output  # the same workload: accepted, then run

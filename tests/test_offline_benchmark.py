"""benchmarks/offline_throughput.py: its step-time histogram (one per kind of step) and the host's time per step it
reports (on a GPU also the GPU's idle share: tests/test_gpu_idle_gpu.py)."""
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
from offline_throughput import histogram, run_workload  # noqa: E402


def test_the_histogram_counts_every_step_and_its_percentiles_are_ordered():
    times = [random.uniform(0.001, 0.02) for _ in range(500)]
    text = histogram(times, bins=5)
    percentiles = [float(text.split(f"{name} ")[1].split()[0].rstrip(";"))
                   for name in ("p10", "p50", "p90", "p99", "max")]
    assert percentiles == sorted(percentiles) and abs(percentiles[-1] - max(times) * 1e3) < 0.01
    cells = text.split("steps) ")[1].split()
    assert len(cells) == 5 and sum(int(c.split(":")[1]) for c in cells) == 500
    assert float(cells[0].split(":")[0]) == round(min(times) * 1e3, 1)


def test_equal_times_fall_in_one_bin():
    cells = histogram([0.004] * 7, bins=3).split("steps) ")[1].split()
    assert [int(c.split(":")[1]) for c in cells] == [7, 0, 0]


def test_the_workload_reports_the_hosts_time_per_step_and_a_slower_host_shows_in_it(make_engine, capsys, monkeypatch):
    import time

    from tsdev_runtime.engine.model_runner import ModelRunner
    from tsdev_runtime.engine.sequence import SamplingParams

    engine = make_engine()
    prompts = [[5 + i, 6, 7, 8] for i in range(4)]
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)] * 4

    def host_ms() -> float:
        tok_s = run_workload(engine, prompts, params, "cpu")
        out = capsys.readouterr().out
        last = out.strip().splitlines()[-1]
        assert "decode steps: " in out and last.startswith("tsdev: 4 requests, 16 prompt + 48 output tokens"), out
        assert tok_s > 0
        return float(out.split("host per step: ")[1].split(" ms")[0])

    plain = host_ms()
    prepare = ModelRunner.host_inputs
    # every step prepares its inputs once: a sleep of twice the plain run's host time per step (at least 100 ms; a
    # loaded 2-core machine's plain steps took 37 and 193 ms in CI) in each makes it slower whatever the load
    pause_ms = max(100.0, 2 * plain)
    monkeypatch.setattr(ModelRunner, "host_inputs",
                        lambda self, batch: time.sleep(pause_ms / 1e3) or prepare(self, batch))
    slow = host_ms()
    assert 0 < plain < slow and slow >= pause_ms, (plain, slow, pause_ms)  # (a sleep is never shorter)

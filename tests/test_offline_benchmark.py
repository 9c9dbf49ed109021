"""benchmarks/offline_throughput.py's step-time histogram (issue 18 asks for one per kind of step)."""
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
from offline_throughput import histogram  # noqa: E402


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

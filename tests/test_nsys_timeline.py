"""benchmarks/nsys_timeline.py: busy and idle GPU time, gaps and step periods from nsys's CSV exports."""
import csv
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
from nsys_timeline import idle_gaps, step_table  # noqa: E402

OPS = [(0, 10, "a"), (5, 20, "b"), (50, 60, "_decode_kernel"), (60, 70, "nvjet_x"), (100, 130, "c")]


def test_overlapping_ops_count_once_and_each_gap_names_the_op_that_ended_it():
    busy, gaps = idle_gaps(OPS)
    assert busy == 20 + 20 + 30
    assert gaps == [(30, 20, "_decode_kernel"), (30, 70, "c")]


def test_a_step_window_counts_the_gpu_time_inside_it_only():
    assert step_table(OPS, [0, 55, 130]) == [(55, 25), (75, 45)]


def test_the_script_reads_the_csv_exports(tmp_path):
    trace, nvtx = tmp_path / "t_cuda_gpu_trace.csv", tmp_path / "t_nvtx_pushpop_trace.csv"
    with trace.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Start (ns)", "Duration (ns)", "Name"])
        writer.writerows([s, e - s, n] for s, e, n in OPS)
    with nvtx.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Start (ns)", "End (ns)", "Name"])
        writer.writerows([[0, 5, "tsdev:schedule"], [55, 58, "tsdev:schedule"], [130, 131, "tsdev:schedule"]])
    out = subprocess.run([sys.executable, str(Path(__file__).parent.parent / "benchmarks" / "nsys_timeline.py"),
                          str(trace), "--nvtx", str(nvtx)], capture_output=True, text=True, check=True).stdout
    assert "GPU busy 0.000 s (53.8%)" in out  # 70 of 130 ns
    assert "decode attention" in out and "GEMM" in out
    assert "2 steps" in out

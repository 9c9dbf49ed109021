"""`tsdev profile`: run the server under Nsight Systems and take one report per reload.

Each capture range is opened with POST /start_profile (cudaProfilerStart under nsys, which writes one
report per range with --capture-range-end=repeat) while a small fixed workload runs, and closes itself
after N engine steps. nsys (2025.3, measured on the H200) writes the reports only when the server exits, so with nsys
they are renamed after their reloads (reload-3.nsys-rep) and summarised when `tsdev profile` stops: with
`nsys stats` (top kernels by GPU time, NVTX step ranges) into reload-3.summary.csv / .md, with the
change per kernel against the previous range. Without nsys, the torch profiler writes a trace per range,
summarised as it closes: its GPU kernels, or on a CPU server its operators by self CPU time, and the same
step ranges (the runtime's NVTX ranges are also `record_function` labels while a torch profiler records).
"""
import csv
import glob
import io
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

NSYS_FLAGS = ["profile", "--trace=cuda,nvtx", "--sample=none", "--cpuctxsw=none", "--cuda-graph-trace=node",
              "--capture-range=cudaProfilerApi", "--capture-range-end=repeat", "--force-overwrite=true"]
NSYS_GLOBS = ["/opt/nvidia/nsight-compute/*/host/target-linux-x64/nsys", "/opt/nvidia/nsight-systems/*/bin/nsys",
              "/usr/local/cuda/bin/nsys", "/usr/local/cuda-*/bin/nsys"]


def find_nsys() -> tuple[str | None, list[str]]:
    """The nsys binary (PATH, $NSYS, or the copy inside an Nsight Compute install) and where we looked."""
    looked = ["PATH"]
    if found := shutil.which("nsys"):
        return found, looked
    if env := os.environ.get("NSYS"):
        looked.append(f"$NSYS={env}")
        if os.access(env, os.X_OK):
            return env, looked
    for pattern in NSYS_GLOBS:
        looked.append(pattern)
        for candidate in sorted(glob.glob(pattern), reverse=True):
            if os.access(candidate, os.X_OK):
                return candidate, looked
    return None, looked


@dataclass
class KernelRow:
    name: str
    total_ns: float
    instances: int
    avg_ns: float


def parse_kernel_csv(text: str) -> list[KernelRow]:
    """Rows of `nsys stats --report cuda_gpu_kern_sum --format csv`, largest total first."""
    return _parse_summary(text, "Name")


def parse_nvtx_csv(text: str) -> list[KernelRow]:
    """Rows of `nsys stats --report nvtx_sum --format csv` (NVTX ranges: schedule/prepare/forward/sample)."""
    return _parse_summary(text, "Range")


def _parse_summary(text: str, name_column: str) -> list[KernelRow]:
    rows = [KernelRow(row[name_column], float(row["Total Time (ns)"]), int(row["Instances"]), float(row["Avg (ns)"]))
            for row in csv.DictReader(io.StringIO(_csv_body(text)))]
    return sorted(rows, key=lambda r: -r.total_ns)


def _csv_body(text: str) -> str:
    """nsys may print notices before the CSV header; keep from the header on."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"Time') or line.startswith("Time")), 0)
    return "\n".join(lines[start:])


@dataclass
class TraceSummary:
    """A torch profiler trace: its GPU kernels (`on_gpu`) or, without any, its CPU operators by self time;
    and its step ranges (the runtime's `tsdev:*` labels, wall time on the host)."""
    rows: list[KernelRow]
    steps: list[KernelRow]
    on_gpu: bool


def torch_trace_summary(path: Path) -> TraceSummary:
    """Summarise a torch.profiler Chrome trace, largest total first.

    GPU kernels do not nest: each row is the sum of its kernels' durations. CPU operators do (aten::linear
    runs aten::addmm): each row is their self time, an operator's duration minus that of the operators and
    ranges it ran on the same thread, so the rows add up to at most the traced wall time.
    """
    import json

    events = [e for e in json.loads(Path(path).read_text()).get("traceEvents", []) if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    ranges = [e for e in events if e.get("cat") == "user_annotation"]
    if kernels:
        rows = _totals((e["name"], float(e.get("dur", 0)) * 1e3) for e in kernels)
    else:
        rows = _totals(_self_times([e for e in events if e.get("cat") == "cpu_op"] + ranges, "cpu_op"))
    steps = _totals((e["name"], float(e.get("dur", 0)) * 1e3) for e in ranges if e["name"].startswith("tsdev:"))
    return TraceSummary(rows, steps, bool(kernels))


def _self_times(events: list[dict], cat: str):
    """(name, self ns) of each event of category `cat`: its duration minus its children's (events that start
    and end inside it on the same thread, found by the nesting of ts/dur)."""
    by_thread: dict = {}
    for e in events:
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for thread in by_thread.values():
        thread.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0))))
        stack: list[list] = []  # [end, event, self time]
        done = []
        for e in thread:
            start, dur = float(e["ts"]), float(e.get("dur", 0))
            while stack and stack[-1][0] <= start:
                done.append(stack.pop())
            if stack:
                parent = stack[-1]
                parent[2] -= min(start + dur, parent[0]) - start  # a child rounded past its parent's end
            stack.append([start + dur, e, dur])
        done += stack
        for _, e, own in done:
            if e.get("cat") == cat:
                yield e["name"], max(own, 0.0) * 1e3


def _totals(pairs) -> list[KernelRow]:
    totals: dict[str, list[float]] = {}
    for name, ns in pairs:
        totals.setdefault(name, []).append(ns)
    return sorted((KernelRow(n, sum(d), len(d), sum(d) / len(d)) for n, d in totals.items()), key=lambda r: -r.total_ns)


def write_summary(prefix: Path, kernels: list[KernelRow], nvtx: list[KernelRow],
                  previous: list[KernelRow] | None, top: int = 15, cpu: bool = False) -> str:
    """Write PREFIX.summary.csv and PREFIX.summary.md; return the markdown.

    `kernels`: GPU kernels by GPU time, or with `cpu` CPU operators by self CPU time; `nvtx`: step ranges.
    """
    before = {k.name: k for k in previous or []}
    kind = "cpu_op" if cpu else "kernel"
    with open(f"{prefix}.summary.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["kind", "name", "total_ms", "instances", "mean_us", "previous_total_ms", "change_pct"])
        for row_kind, rows in ((kind, kernels), ("nvtx", nvtx)):
            for r in rows:
                old = before.get(r.name) if row_kind == kind else None
                w.writerow([row_kind, r.name, f"{r.total_ns / 1e6:.4f}", r.instances, f"{r.avg_ns / 1e3:.3f}",
                            f"{old.total_ns / 1e6:.4f}" if old else "", _pct(r, old)])
    total = sum(k.total_ns for k in kernels) or 1
    head = ("| CPU op | self CPU time (ms) | share | calls |" if cpu
            else "| kernel | GPU time (ms) | share | instances |")
    lines = [f"## {prefix.name}", "", head + " mean (us) | vs previous |", "|---|---:|---:|---:|---:|---:|"]
    for r in kernels[:top]:
        lines.append(f"| `{r.name[:80]}` | {r.total_ns / 1e6:.3f} | {r.total_ns / total:.0%} | {r.instances} | "
                     f"{r.avg_ns / 1e3:.2f} | {_pct(r, before.get(r.name)) or 'new' if previous else ''} |")
    if nvtx:
        lines += ["", "| NVTX range | total (ms) | instances | mean (us) |", "|---|---:|---:|---:|"]
        lines += [f"| {r.name} | {r.total_ns / 1e6:.3f} | {r.instances} | {r.avg_ns / 1e3:.2f} |" for r in nvtx[:top]]
    markdown = "\n".join(lines) + "\n"
    Path(f"{prefix}.summary.md").write_text(markdown)
    return markdown


def _pct(new: KernelRow, old: KernelRow | None) -> str:
    return f"{(new.total_ns - old.total_ns) / old.total_ns * 100:+.1f}%" if old and old.total_ns else ""


def nsys_stats(nsys: str, report: Path) -> tuple[list[KernelRow], list[KernelRow]]:
    """Kernel and NVTX summaries of one report (runs `nsys stats`)."""
    prefix = report.with_suffix("")
    subprocess.run([nsys, "stats", "--force-export=true", "--report", "cuda_gpu_kern_sum", "--report", "nvtx_sum",
                    "--format", "csv", "--output", str(prefix), str(report)], check=True, capture_output=True,
                   timeout=300)
    kern = Path(f"{prefix}_cuda_gpu_kern_sum.csv")
    nvtx = Path(f"{prefix}_nvtx_sum.csv")
    return (parse_kernel_csv(kern.read_text()) if kern.exists() else [],
            parse_nvtx_csv(nvtx.read_text()) if nvtx.exists() else [])


def run_profile(server_args: list[str], out_dir: Path, num_steps: int, max_ranges: int | None, port: int, console,
                api_key: str | None = None) -> int:
    """Serve under nsys (or plain, with torch traces) and take a range at start and after every reload.

    The server's profile directory is `out_dir` (--profile-dir), so ranges are asked for by name only; `api_key`
    reaches the server in its environment and goes with every request."""
    import queue
    import threading

    import httpx
    from rich.markdown import Markdown

    from tsdev_runtime.control_protocol import START_PROFILE_ROUTE, ProfileRequest
    from tsdev.client import auth_headers, body
    from tsdev.launch.child import ServerProcess, StartFailed

    nsys, looked = find_nsys()
    out_dir.mkdir(parents=True, exist_ok=True)
    if nsys:
        prefix, activities = [nsys, *NSYS_FLAGS, "-o", str(out_dir / "range-%n")], ["CUDA_PROFILER"]
        console.print(f"profiling with {nsys}; reports go to {out_dir}/")
    else:
        prefix, activities = [], ["TORCH"]
        console.print(f"[yellow]nsys not found[/yellow] (looked in {', '.join(looked)}): taking torch profiler "
                      f"traces instead (Chrome/Perfetto JSON in {out_dir}/)")
    server_args = [*server_args, "--profile-dir", str(out_dir.resolve())]  # the last --profile-dir is the one taken
    server = ServerProcess(server_args, port, allow_reload_forward=True, prefix=prefix,  # its output: the terminal
                           api_key=api_key)
    url, headers = server.url, auth_headers(api_key)
    events: queue.Queue = queue.Queue()
    stop = threading.Event()
    names: list[str] = []  # ranges taken, in order (nsys numbers its reports the same way)
    try:
        server.start()
        server.wait_healthy()
        threading.Thread(target=_listen, args=(url, events, stop, headers), daemon=True).start()
        console.print(f"server at {url}: edit, then `tsdev reload --url {url}`; each reload gets a report")
        previous, name = None, "reload-0"
        while True:
            _clear(events)
            request = ProfileRequest(activities=activities, num_steps=num_steps, name=name)
            httpx.post(url + START_PROFILE_ROUTE, json=body(request), timeout=30, headers=headers).raise_for_status()
            _run_workload_until_closed(url, events, name, headers)
            names.append(name)
            if nsys:
                console.print(f"range {name} taken (nsys writes its report when the server stops)")
            else:
                trace = torch_trace_summary(out_dir / f"{name}.trace.json")
                console.print(Markdown(write_summary(out_dir / name, trace.rows, trace.steps, previous,
                                                     cpu=not trace.on_gpu)))
                previous = trace.rows
            if max_ranges is not None and len(names) >= max_ranges:
                break
            name = f"reload-{_next_reload(events, server.proc).n}"
        return 0
    except KeyboardInterrupt:
        return 0
    except StartFailed as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    except (RuntimeError, TimeoutError) as exc:  # the server exited, or a range could not be taken
        console.print(f"[red]error:[/red] {exc}")
        return 1
    finally:
        stop.set()
        server.stop(timeout=600)  # nsys processes every range's report on the way out
        if nsys:
            summarize_nsys_ranges(nsys, out_dir, names, console)


def summarize_nsys_ranges(nsys: str, out_dir: Path, names: list[str], console) -> None:
    """Name nsys's range-K reports after the reloads they belong to and summarise each against the last.

    nsys (2025.3, measured on the H200) writes every range's report only when the application exits,
    so this runs once the server has stopped.
    """
    from rich.markdown import Markdown

    previous = None
    for k, name in enumerate(names, start=1):
        report = out_dir / f"range-{k}.nsys-rep"
        if not report.exists():
            console.print(f"[red]nsys wrote no report for range {k} ({name})[/red]")
            continue
        target = out_dir / f"{name}.nsys-rep"
        report.rename(target)
        kernels, nvtx = nsys_stats(nsys, target)
        console.print(Markdown(write_summary(out_dir / name, kernels, nvtx, previous)))
        previous = kernels


def _listen(url: str, events, stop, headers: dict[str, str]) -> None:
    """The server's events, parsed, into `events` (reconnecting) until `stop` is set."""
    import httpx

    from tsdev_runtime.control_protocol import EVENTS_ROUTE, parse_event
    from tsdev.client import iter_sse_data

    while not stop.is_set():
        try:
            with httpx.stream("GET", url + EVENTS_ROUTE, timeout=None, headers=headers) as r:
                for data in iter_sse_data(r):
                    if (event := parse_event(data)) is not None:
                        events.put(event)
        except httpx.HTTPError:
            time.sleep(0.5)


def _clear(events) -> None:
    while not events.empty():
        events.get_nowait()


def _next_reload(events, proc):
    """The next successful reload's ReloadFinished event (waits as long as the server runs)."""
    import queue

    from tsdev_runtime.control_protocol import ReloadFinished

    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        try:
            event = events.get(timeout=0.5)
        except queue.Empty:
            continue
        if isinstance(event, ReloadFinished) and event.worker.ok:
            return event


def _run_workload_until_closed(url: str, events, name: str, headers: dict[str, str], timeout: float = 300) -> None:
    """A small fixed workload (8 requests of 64 tokens at a time) until the range `name` closes."""
    import queue
    import threading

    import httpx

    from tsdev_runtime.control_protocol import ProfileFinished

    closed = threading.Event()

    def client() -> None:
        with httpx.Client(timeout=120, headers=headers) as c:
            while not closed.is_set():
                c.post(url + "/v1/completions", json={"prompt": list(range(1, 65)), "max_tokens": 64,
                                                     "ignore_eos": True, "temperature": 0})

    threads = [threading.Thread(target=client, daemon=True) for _ in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                event = events.get(timeout=0.5)
            except queue.Empty:
                continue
            if isinstance(event, ProfileFinished) and event.name == name:
                if event.error:
                    raise RuntimeError(f"the server could not write range {name}: {event.error}")
                return
        raise TimeoutError(f"capture range {name} did not close within {timeout:.0f} s")
    finally:
        closed.set()
        for t in threads:
            t.join(130)

"""Issue 69's drill, as a kernel author would do it: `tsdev watch` (the TUI) on the default model in a temporary copy of
the project, a sequence of saves of the RMSNorm kernel's launcher and body -- fewer warps, more warps, a wrong edit
(its check fails, rolled back), the file put back -- then the TUI's picture (each changed kernel's row: its share of
the limit and its sparkline), and the notebook read back: `tsdev history`, `tsdev history rms_norm` (the chart),
`--html`, `--best rms_norm`. Everything lands in $OUT (default /tmp/notebook-drill).

    python3 scripts/notebook_drill.py                 # the GPU (CUDA), the default model
    python3 scripts/notebook_drill.py --device cpu    # the same moves on the CPU (Triton's interpreter checks)
"""
import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tsdev.launch.child import copy_project, project_pythonpath

NORM = "kernels/tsdev_kernels/ops/norm.py"
ROW = "    return w * (x * rstd).to(dt).to(tl.float32)"  # rms_norm_values: the normalized row
SETTLE_S = 8
WARPS = "num_warps=min(max(BLOCK // 256, 1), 8)"
EDITS = [  # (what the author tries, old, new): each on the file as the last save left it
    ("fewer warps", WARPS, "num_warps=min(max(BLOCK // 512, 1), 8)"),
    ("more warps", "num_warps=min(max(BLOCK // 512, 1), 8)", "num_warps=min(max(BLOCK // 128, 1), 16)"),
    ("a wrong edit (its kernel check must fail)", ROW, "    return 1.5 * " + ROW.removeprefix("    return ")),
    ("the file put back", None, None),
]


async def drive(project: Path, out: Path, device: str, port: int) -> None:
    from tsdev.watch import WatchConfig
    from tsdev.watch.tui import WatchApp

    original = (project / NORM).read_text()
    app = WatchApp(WatchConfig(model=None, server_args=["--device", device, "--port", str(port)], port=port,
                               project=project, server_log=out / "server.log"))
    async with app.run_test(size=(160, 44)) as pilot:
        while app.daemon.info["state"] != "serving" or not app.daemon.watcher.ready.is_set():
            await pilot.pause(0.5)
        for what, old, new in EDITS:
            text = (project / NORM).read_text()
            assert old is None or old in text, old
            (project / NORM).write_text(original if old is None else text.replace(old, new, 1))
            print(f"saved: {what}", flush=True)
            await pilot.pause(SETTLE_S)  # the reload, its checks and the decode probe
            while app.daemon.info["state"] != "serving":
                await pilot.pause(0.5)
        (out / "watch-tui.svg").write_text(app.export_screenshot(title="tsdev watch: the notebook"))
        await pilot.press("q")
        while app.return_code is None:
            await pilot.pause(0.2)


def history(project: Path, out: Path, *args: str) -> None:
    result = subprocess.run([sys.executable, "-m", "tsdev", "history", "--project", str(project), *args],
                            capture_output=True, text=True, cwd=project, env={**os.environ, "COLUMNS": "160"})
    text = f"$ tsdev history {' '.join(args)}\n{result.stdout}{result.stderr}"
    print(text, flush=True)
    with open(out / "history.txt", "a") as f:
        f.write(text + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--port", type=int, default=18777)
    args = parser.parse_args()
    out = Path(os.environ.get("OUT", "/tmp/notebook-drill"))
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(tmp)
        copy_project(project)
        os.chdir(project)
        sys.path[:0] = project_pythonpath(project, "").split(os.pathsep)
        start = time.time()
        asyncio.run(drive(project, out, args.device, args.port))
        print(f"drill done in {time.time() - start:.0f} s", flush=True)
        history(project, out)
        history(project, out, "rms_norm")
        history(project, out, "rms_norm", "--html", str(out / "history.html"))
        history(project, out, "--best", "rms_norm")
    print(f"wrote {out}/watch-tui.svg, history.html, history.txt")


if __name__ == "__main__":
    main()

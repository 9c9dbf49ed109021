"""Take the README's picture of `tsdev watch`: a real session (CPU) in a temporary copy of the project,
on a tiny Qwen3 with random weights large enough that an edit shows in the greedy output (the embedded
default's small weights give repetitive text): a kernel edit that changes the output, the edit
undone, an engine edit that needs a restart, and a syntax error. Writes docs/watch-tui.png with
rsvg-convert (`apt-get install librsvg2-bin`), or leaves docs/watch-tui.svg when that is missing.
"""
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tsdev.launch.child import copy_project, project_pythonpath

ROOT = Path(__file__).resolve().parent.parent
SHAPE = dict(vocab_size=1024, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, torch_dtype="float32")
EDITS = [  # (file, old, new, seconds to wait)
    ("kernels/tsdev_kernels/ops/activation.py", "    return F.silu(gate) * up\n", "    return -F.silu(gate) * up\n", 3),
    ("kernels/tsdev_kernels/ops/activation.py", "    return -F.silu(gate) * up\n", "    return F.silu(gate) * up\n", 3),
    ("runtime/tsdev_runtime/engine/scheduler.py", '"""', '"""Edited: ', 25),
    ("kernels/tsdev_kernels/ops/activation.py", "    return F.silu(gate) * up\n", "    return F.silu(gate) * up)\n", 3),
]


async def main(project: Path) -> None:
    from tsdev_runtime.weights.default_model import write_checkpoint
    from tsdev.watch import WatchConfig
    from tsdev.watch.tui import WatchApp

    model = project / "qwen3-tiny"
    model.mkdir()
    write_checkpoint(model, SHAPE, seed=1, std=0.2)
    app = WatchApp(WatchConfig(model=str(model), server_args=["--device", "cpu", "--port", "18765"], port=18765,
                               project=project))
    async with app.run_test(size=(172, 44)) as pilot:
        while app.daemon.info["state"] != "serving" or not app.daemon.watcher.ready.is_set():
            await pilot.pause(0.2)
        for path, old, new, wait in EDITS:
            file = project / path
            file.write_text(file.read_text().replace(old, new, 1))
            await pilot.pause(wait)
            while app.daemon.info["state"] != "serving":
                await pilot.pause(0.2)
        await pilot.pause(0.5)
        svg = app.export_screenshot(title="tsdev watch")
        # rsvg-convert drops non-breaking spaces at the start of a text run: use plain ones, preserved
        svg = svg.replace("&#160;", " ").replace("<svg ", '<svg xml:space="preserve" ', 1)
        (ROOT / "docs" / "watch-tui.svg").write_text(svg)
        if shutil.which("rsvg-convert"):
            subprocess.run(["rsvg-convert", "docs/watch-tui.svg", "-o", "docs/watch-tui.png"], cwd=ROOT, check=True)
            (ROOT / "docs" / "watch-tui.svg").unlink()
        await pilot.press("q")
        while app.return_code is None:
            await pilot.pause(0.2)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(tmp)
        copy_project(project)
        os.chdir(project)
        sys.path[:0] = project_pythonpath(project, "").split(os.pathsep)
        start = time.time()
        asyncio.run(main(project))
        print(f"took the screenshot in {time.time() - start:.0f} s: docs/watch-tui.png (or .svg)")

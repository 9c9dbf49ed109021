"""The watcher on real file saves, the way editors make them (docs/watch.md, "What happens on a save")."""
import asyncio
import os
import tempfile
import time
from pathlib import Path

import pytest

from tsdev.watch.watcher import Packages, Watcher, classify_files, module_name

ACT = "kernels/tsdev_kernels/ops/act.py"
SOURCE = "def act(x):\n    return x\n"


@pytest.fixture
def project(tmp_path):
    for path, text in {"kernels/tsdev_kernels/__init__.py": "", "kernels/tsdev_kernels/ops/__init__.py": "",
                       ACT: SOURCE,
                       "runtime/tsdev_runtime/__init__.py": "", "runtime/tsdev_runtime/layers/__init__.py": "",
                       "runtime/tsdev_runtime/layers/norm.py": "X = 1\n",
                       "runtime/tsdev_runtime/engine/__init__.py": "",
                       "runtime/tsdev_runtime/engine/scheduler.py": "Y = 1\n",
                       "kernels/tsdev_kernels/ops/README.md": "notes\n"}.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    (tmp_path / "pyproject.toml").write_text('[tool.tsdev]\n'
                                             'reload-packages = ["tsdev_kernels.ops", "tsdev_runtime.layers"]\n'
                                             '[tool.setuptools.packages.find]\nwhere = [".", "runtime", "kernels"]\n')
    return tmp_path


def batches_during(project: Path, save, quiet: float = 0.8, **watcher_args) -> list:
    """Run `save` (blocking file operations) while the watcher runs; every batch it yields until `quiet` after."""
    async def main():
        watcher = Watcher(Packages.locate(["tsdev_kernels.ops", "tsdev_runtime.layers"], project), **watcher_args)
        stop, found = asyncio.Event(), []

        async def consume():
            async for changes in watcher.batches(stop):
                found.append(changes)

        task = asyncio.create_task(consume())
        await watcher.ready.wait()
        await asyncio.sleep(0.3)  # as in real use, the watcher has been running a while before the save
        await asyncio.to_thread(save)
        await asyncio.sleep(quiet)
        stop.set()
        await asyncio.wait_for(task, 5)
        return found

    return asyncio.run(main())


def test_plain_write_is_one_batch_with_the_module_and_its_save_time(project):
    before = time.time()
    found = batches_during(project, lambda: (project / ACT).write_text(SOURCE + "# edited\n"))
    assert len(found) == 1
    assert found[0].reload == ["tsdev_kernels.ops.act"] and found[0].restart == [] and found[0].files == [ACT]
    assert found[0].saved_at == (project / ACT).stat().st_mtime and found[0].saved_at >= before - 0.05


def test_atomic_rename_does_not_leak_the_temp_name(project):
    def save():
        folder = project / "kernels/tsdev_kernels/ops"
        with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".py", delete=False) as tmp:
            tmp.write(SOURCE + "# atomic\n")
        os.replace(tmp.name, folder / "act.py")

    found = batches_during(project, save)
    assert [(c.files, c.reload) for c in found] == [([ACT], ["tsdev_kernels.ops.act"])]


def test_vim_save_with_probe_file_and_delete_then_add(project):
    def save():
        folder, target = project / "kernels/tsdev_kernels/ops", project / ACT
        (folder / "4913").write_text("")  # vim's "can I create files here" probe
        (folder / "4913").unlink()
        os.rename(target, folder / "act.py~")  # backup, then the new file under the old name
        target.write_text(SOURCE + "# vim\n")
        (folder / "act.py~").unlink()

    found = batches_during(project, save)
    assert [(c.files, c.reload) for c in found] == [([ACT], ["tsdev_kernels.ops.act"])]


@pytest.mark.slow
def test_formatter_writing_again_100ms_later_gives_one_batch_with_settle_ms_200(project):
    def save():
        (project / ACT).write_text(SOURCE + "#  unformatted\n")
        time.sleep(0.1)
        (project / ACT).write_text(SOURCE + "# formatted\n")

    found = batches_during(project, save, settle=0.2)  # the default (50 ms) reloads sooner: twice here
    assert len(found) == 1 and found[0].reload == ["tsdev_kernels.ops.act"]


def test_save_without_change_and_other_files_are_ignored(project):
    def save():
        (project / ACT).write_text(SOURCE)  # same content: nothing to reload
        (project / "kernels/tsdev_kernels/ops/README.md").write_text("more notes\n")
        (project / "kernels/tsdev_kernels/ops/.act.py.swp").write_text("x")

    assert batches_during(project, save) == []


def test_edit_outside_the_reloadable_packages_asks_for_a_restart(project):
    def save():
        (project / "runtime/tsdev_runtime/engine/scheduler.py").write_text("Y = 2\n")
        (project / "runtime/tsdev_runtime/layers/norm.py").write_text("X = 2\n")

    found = batches_during(project, save)
    assert len(found) == 1
    assert found[0].restart == ["tsdev_runtime.engine.scheduler"] and found[0].reload == ["tsdev_runtime.layers.norm"]


def test_files_map_to_modules_by_their_packages(project):
    assert module_name(project / ACT) == "tsdev_kernels.ops.act"
    assert module_name(project / "kernels/tsdev_kernels/ops/__init__.py") == "tsdev_kernels.ops"
    assert module_name(project / "pyproject.toml") is None
    reload, others, ignored = classify_files([project / ACT, project / "runtime/tsdev_runtime/engine/scheduler.py",
                                              project / "pyproject.toml",
                                              project / "kernels/tsdev_kernels/ops/README.md"])
    assert reload == ["tsdev_kernels.ops.act"] and others == ["tsdev_runtime.engine.scheduler"]
    assert ignored == [str(project / "pyproject.toml"), str(project / "kernels/tsdev_kernels/ops/README.md")]

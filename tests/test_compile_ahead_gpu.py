"""An editor's unsaved buffer compiled ahead by a `tsdev serve` on the GPU (its compile pool): real binaries are
built while the old code serves and nothing is reloaded; the save of that text then reloads with nothing compiled in
the pause, and its jit step reuses the build (the same binaries, none compiled again)."""
import random

import httpx
import pytest

from serve_process import copy_project, serve
from test_reload_forward import complete, new_id, reload
from tsdev_runtime.control_protocol import CompileAheadReply

pytestmark = pytest.mark.gpu
ACTIVATION = "kernels/tsdev_kernels/ops/activation.py"
HELPER = "    return act * up\n"


def test_a_buffer_built_ahead_serves_nothing_new_and_its_save_compiles_nothing_in_the_pause(tiny_model_dir, tmp_path):
    project = copy_project(tmp_path / "project")
    file = project / ACTIVATION
    original = file.read_text()
    assert HELPER in original, f"{ACTIVATION} no longer holds {HELPER!r}: update this test's edit"
    constant = f"{1 + random.uniform(1e-4, 1e-3):.12f}"  # never in Triton's cache: a real compile
    edited = original.replace(HELPER, f"    return -act * up * {constant}\n")
    args = [str(tiny_model_dir), "--device", "cuda", "--max-model-len", "1024", "--allow-reload-forward"]
    with serve(args, tmp_path / "serve.log", cwd=project, timeout=240) as url:
        before = complete(url)["text"]
        r = httpx.post(url + "/v1/rl/engine/compile_ahead", json={"path": str(file), "text": edited}, timeout=300)
        assert r.status_code == 200, r.text
        built = CompileAheadReply.model_validate_json(r.content)
        assert built.outcome == "compiled" and built.compiled > 0 and not built.reused, built
        assert complete(url)["text"] == before  # nothing reloaded: the old code serves
        file.write_text(edited)  # the save, of the text sent
        try:
            reply = reload(url, new_id())
            worker = reply.workers[0]
            assert reply.ok and worker.reloaded == ["tsdev_kernels.ops.activation"], reply
            assert worker.compiled_in_pause == {} and worker.jit_kernels >= built.compiled, worker
            assert complete(url)["text"] != before
        finally:
            file.write_text(original)
        assert reload(url, new_id()).ok and complete(url)["text"] == before

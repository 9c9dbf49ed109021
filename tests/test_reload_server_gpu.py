"""A kernel body edit reloaded by a fresh `tsdev serve` on the GPU: the reload loads the new binaries instead of
running the warm-up, so its recapture is the first CUDA work of the engine's thread beyond graph replays (the
thread must already hold its cuBLAS handles: a capture cannot create them)."""
import httpx
import pytest

from serve_process import copy_project, serve
from test_reload_forward import complete, edited, new_id, reload

pytestmark = pytest.mark.gpu
ACTIVATION = "kernels/tsdev_kernels/ops/activation.py"
HELPER = "    return act * up\n"


def test_a_kernel_body_edit_reloads_without_a_warm_up_and_a_revert_restores_the_output(tiny_model_dir, tmp_path):
    project = copy_project(tmp_path / "project")
    args = [str(tiny_model_dir), "--device", "cuda", "--max-model-len", "1024", "--allow-reload-forward"]
    with serve(args, tmp_path / "serve.log", cwd=project, timeout=240) as url:
        before = complete(url)["text"]  # prefill and decode: graph replays on the engine's thread
        with edited(project, ACTIVATION, HELPER, "    return -act * up\n"):
            reply = reload(url, new_id())
            assert reply.ok, reply
            assert reply.workers[0].kernels_only and reply.workers[0].graph_nodes_patched > 0  # graphs not captured
            edited_text = complete(url)["text"]
        reverted = reload(url, new_id())
        assert reverted.ok and reverted.workers[0].kernels_only and reverted.workers[0].graph_nodes_patched, reverted
        assert complete(url)["text"] == before != edited_text
        assert httpx.get(url + "/health", timeout=10).status_code == 200

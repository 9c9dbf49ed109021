"""Pinned staging load on CUDA (on the H200: `just device-test tests/test_weights_gpu.py -s`): every parameter
and buffer bit-identical to the plain path, the GB/s of both, and a failed registration leaves CUDA usable."""
import sys

import pytest
import torch

from tsdev_runtime.config import ModelConfig
from tsdev_runtime.models import build_model
from tsdev_runtime.weights import pinned
from tsdev_runtime.weights.default_model import default_model_dir
from tsdev_runtime.weights.loader import load_weights

pytestmark = pytest.mark.gpu


def cuda_model(model_dir):
    """The model as the runner builds it on CUDA: the checkpoint's dtype, allocated on the device."""
    config = ModelConfig.from_dir(model_dir)
    return build_model(config, "cuda", getattr(torch, config.torch_dtype))


def assert_bit_identical(a, b):
    ta = {**dict(a.named_parameters()), **dict(a.named_buffers())}
    tb = {**dict(b.named_parameters()), **dict(b.named_buffers())}
    assert ta.keys() == tb.keys()
    for name in ta:
        x, y = ta[name].detach().reshape(-1), tb[name].detach().reshape(-1)
        assert x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8)), name


@pytest.fixture(scope="module")
def model_dir():
    return default_model_dir("cuda")


def test_pinned_load_is_bit_identical_to_plain_and_reports_gb_per_s(model_dir):
    plain, staged = cuda_model(model_dir), cuda_model(model_dir)
    plain_weights = load_weights(plain, model_dir, "plain")  # the first read may come from disk: not timed
    staged_weights = load_weights(staged, model_dir, "pinned")
    reports = {"plain": [], "pinned": []}
    for _ in range(3):  # weight updates, in place
        reports["plain"].append(plain_weights.load(model_dir, "plain"))
        reports["pinned"].append(staged_weights.load(model_dir, "pinned"))
    assert all(r.format == "pinned" for r in reports["pinned"])
    assert_bit_identical(plain, staged)
    for fmt, runs in reports.items():
        print(f"\n{fmt}: " + "; ".join(str(r) for r in runs))
    best = {fmt: max(r.gb_per_s for r in runs) for fmt, runs in reports.items()}
    print(f"pinned / plain: {best['pinned'] / best['plain']:.2f}x")


def test_a_small_staging_buffer_splits_large_tensors_and_stays_identical(model_dir):
    plain, staged = cuda_model(model_dir), cuda_model(model_dir)
    load_weights(plain, model_dir, "plain")
    # 32 MiB slots: the 311 MB embedding is split
    report = load_weights(staged, model_dir, "pinned", memory_limit=64 << 20).report
    print(f"\n{report}")
    assert report.format == "pinned" and "32 MiB" in report.detail
    assert_bit_identical(plain, staged)


@pytest.mark.parametrize("backend", ["cuda-bindings", "torch-cudart"])
def test_a_failed_registration_raises_pinning_unavailable_and_leaves_cuda_usable(backend, monkeypatch):
    if backend == "torch-cudart":
        monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # as if cuda-bindings were not installed
    torch.ones(1, device="cuda")  # a context, as a load has by then
    buffer = pinned.HostBuffer(8 << 20)
    try:
        buffer.pin()
        with pytest.raises(pinned.PinningUnavailable):
            pinned.host_register(buffer.tensor.data_ptr(), buffer.nbytes)  # already registered
        x = torch.arange(1000, device="cuda", dtype=torch.float32)
        assert (x * 2).sum().item() == 999_000  # no stale CUDA error surfaces in torch's launch checks
        dev = torch.empty(buffer.nbytes, dtype=torch.uint8, device="cuda")
        buffer.tensor.fill_(7)
        dev.copy_(buffer.tensor, non_blocking=True)
        torch.cuda.synchronize()
        assert dev.sum().item() == 7 * buffer.nbytes
    finally:
        buffer.close()

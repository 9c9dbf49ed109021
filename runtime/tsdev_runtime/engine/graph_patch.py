"""Point captured CUDA graphs' kernel nodes at new binaries instead of capturing the graphs again.

A reload that changed only Triton kernel bodies loads a new binary for every specialisation the old code had
launched (the reloader's `graph_swaps`: old CUfunction -> (new CUfunction, threads per block, dynamic shared
memory)). The arguments, grids and launch attributes stay what they were, so each captured node that launches an
old binary can run the new one: `cuGraphExecKernelNodeSetParams` on the instantiated graph, a few microseconds a
node, where a capture replays the whole forward pass. The graphs must keep their `cudaGraph_t` (captured with
`torch.cuda.CUDAGraph(keep_graph=True)`): its nodes are what the driver patches by. They keep the parameters
captured (the arguments' storage the executable graph reads them from stays untouched), so the function each
node runs now is kept here, per graph. Driver calls go through ctypes to libcuda, which every CUDA torch loads.
"""
from __future__ import annotations

import ctypes
import weakref
from collections.abc import Iterable, Mapping

import torch

_KERNEL_NODE = 0  # CU_GRAPH_NODE_TYPE_KERNEL


class _KernelNodeParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2 (cuda.h, CUDA 12 and 13)."""
    _fields_ = [("func", ctypes.c_void_p),
                ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint),
                ("kernelParams", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


class GraphPatchError(RuntimeError):
    """The driver refused a node; the nodes patched before it were set back."""


_driver = None
_running: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph -> {node: the function it runs now}


def _cuda():
    global _driver
    if _driver is None:
        lib = ctypes.CDLL("libcuda.so.1")
        for name, args in (("cuGraphGetNodes", (ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t))),
                           ("cuGraphNodeGetType", (ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))),
                           ("cuGraphKernelNodeGetParams_v2", (ctypes.c_void_p, ctypes.POINTER(_KernelNodeParams))),
                           ("cuGraphExecKernelNodeSetParams_v2",
                            (ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(_KernelNodeParams)))):
            getattr(lib, name).argtypes, getattr(lib, name).restype = args, ctypes.c_int
        _driver = lib
    return _driver


def _check(result: int, call: str) -> None:
    if result != 0:
        raise GraphPatchError(f"{call} failed: CUresult {result}")


def _kernel_nodes(graph: int) -> Iterable[tuple[int, _KernelNodeParams]]:
    cuda = _cuda()
    count = ctypes.c_size_t(0)
    _check(cuda.cuGraphGetNodes(graph, None, ctypes.byref(count)), "cuGraphGetNodes")
    nodes = (ctypes.c_void_p * count.value)()
    _check(cuda.cuGraphGetNodes(graph, nodes, ctypes.byref(count)), "cuGraphGetNodes")
    for node in nodes[:count.value]:
        kind = ctypes.c_int(-1)
        _check(cuda.cuGraphNodeGetType(node, ctypes.byref(kind)), "cuGraphNodeGetType")
        if kind.value == _KERNEL_NODE:
            params = _KernelNodeParams()
            _check(cuda.cuGraphKernelNodeGetParams_v2(node, ctypes.byref(params)), "cuGraphKernelNodeGetParams")
            yield node, params


def patch(graphs: Iterable[torch.cuda.CUDAGraph], swaps: Mapping[int, tuple[int, int, int]]) -> int:
    """Point every kernel node of `graphs` that runs a function in `swaps` at its replacement: the number of
    nodes patched. All or nothing: on a refusal the nodes already patched are set back and GraphPatchError
    raised (the caller captures the graphs again)."""
    cuda, done = _cuda(), []

    def set_node(executable, node, params, launch) -> None:
        new = _KernelNodeParams.from_buffer_copy(params)
        new.func, new.blockDimX, new.sharedMemBytes = launch
        _check(cuda.cuGraphExecKernelNodeSetParams_v2(executable, node, ctypes.byref(new)),
               "cuGraphExecKernelNodeSetParams")

    try:
        for graph in graphs:
            executable, running = graph.raw_cuda_graph_exec(), _running.setdefault(graph, {})
            for node, params in _kernel_nodes(graph.raw_cuda_graph()):
                now = running.get(node, (params.func or 0, params.blockDimX, params.sharedMemBytes))
                swap = swaps.get(now[0])
                if swap is not None:
                    set_node(executable, node, params, swap)
                    done.append((executable, running, node, params, now))
                    running[node] = swap
    except Exception:
        for executable, running, node, params, before in reversed(done):
            set_node(executable, node, params, before)
            running[node] = before
        raise
    return len(done)

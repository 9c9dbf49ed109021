# Developer recipes. `just --list` shows them; each is one plain command you can also type yourself.

# install tsdev with the test tools (CPU torch on machines without a GPU)
setup:
    python3 -m pip install torch==2.13.0 -e ".[dev]"

# the CPU test suite (what CI runs: two workers, a test file each at a time)
test *ARGS:
    python3 -m pytest -q -n 2 --dist loadfile {{ARGS}}

# serve the embedded default model (or MODEL) on 127.0.0.1:8000
serve *ARGS:
    tsdev serve {{ARGS}}

# serve and reload on every save, with the step timings on screen (`just watch --no-tui` for plain lines)
watch *ARGS:
    tsdev watch {{ARGS}}

# offline throughput of the engine on the default model
bench *ARGS:
    python3 benchmarks/offline_throughput.py {{ARGS}}

# serve under Nsight Systems (torch profiler without it): one report per reload in profiles/
profile *ARGS:
    tsdev profile {{ARGS}}

# fetch the wheels and .deb files the H200 machine lacks into .whl/ and .debs/ (git-ignored; carry them)
device-prep:
    bash scripts/device-prep.sh

# on a CPU machine with network: vLLM's Triton MoE kernels into the git-ignored .peer/vllm_moe (benchmarks/moe_vs_peer.py; carry .peer)
peer:
    bash scripts/peer-vllm-moe.sh

# on the H200 machine (after `source scripts/device-setup.sh`): the GPU tests
device-test *ARGS:
    python3 -m pytest -q -m gpu {{ARGS}}

# on the H200 machine (after `source scripts/device-setup.sh`): the GPU suite and the open issues' benchmarks
device-check:
    bash scripts/device-check.sh

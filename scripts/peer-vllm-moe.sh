#!/usr/bin/env bash
# The peer of benchmarks/moe_vs_peer.py, into the git-ignored .peer/vllm_moe/ (never committed, measurement only):
# vLLM's Triton MoE kernels (fused_moe_kernel, write_zeros_to_output, _per_token_group_quant_fp8, their bodies as
# released, the imports reduced to torch and triton) and vLLM's tuned configs, taken from the PyPI wheel of the
# release whose kernel signature the benchmark launches (0.11.1: the bias pointer and SPLIT_K). On a CPU machine with
# network; then carry .peer to the device.   run: bash scripts/peer-vllm-moe.sh [VERSION]
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-0.11.1}
dest=.peer/vllm_moe
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: "vllm==$version" -d "$wheels"
rm -rf "$dest" && mkdir -p "$dest/configs"
python3 - "$wheels"/vllm-*.whl "$dest" "$version" <<'EOF'
import ast
import datetime
import hashlib
import sys
import zipfile
from pathlib import Path

wheel, dest, version = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
MOE = "vllm/model_executor/layers/fused_moe/fused_moe.py"
FP8 = "vllm/model_executor/layers/quantization/utils/fp8_utils.py"
WANTED = {MOE: ("write_zeros_to_output", "fused_moe_kernel"), FP8: ("_per_token_group_quant_fp8",)}
with zipfile.ZipFile(wheel) as archive:
    parts, where = [], []
    for path, names in WANTED.items():
        source = archive.read(path).decode()
        lines = source.splitlines(keepends=True)
        found = {node.name: node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)}
        for name in names:
            node = found[name]  # (KeyError: this release lacks it -- pick another version)
            decorators = [ast.get_source_segment(source, d) for d in node.decorator_list]
            if decorators != ["triton.jit"]:
                sys.exit(f"{name} in {path} is decorated {decorators}, not @triton.jit alone: check the release")
            first = node.decorator_list[0].lineno
            parts.append("".join(lines[first - 1:node.end_lineno]))
            where.append(f"# {name}: {path} (lines {first}-{node.end_lineno})")
    configs = [n for n in archive.namelist() if n.startswith("vllm/model_executor/layers/fused_moe/configs/")
               and n.endswith(".json")]
    for name in configs:
        (dest / "configs" / Path(name).name).write_bytes(archive.read(name))
    commit = next((line for line in archive.read("vllm/_version.py").decode().splitlines()
                   if "commit_id" in line and "=" in line), "commit id: not in the wheel")
header = [f"# Measurement-only copy of vLLM's Triton MoE kernels for tsdev's benchmarks/moe_vs_peer.py (never part of "
          f"tsdev).", f"# Upstream: https://github.com/vllm-project/vllm (Apache-2.0), release v{version}, wheel "
          f"{wheel.name}; {commit.strip()}", *where,
          "# Kernel bodies as released; the imports reduced to torch, triton and triton.language.",
          "import torch  # noqa: F401", "import triton", "import triton.language as tl", "", "", ""]
(dest / "vllm_kernels.py").write_text("\n".join(header) + "\n\n\n".join(parts))
digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
(dest / "NOTES.md").write_text(
    f"# vLLM's Triton MoE kernels: the peer of benchmarks/moe_vs_peer.py (git-ignored, never committed)\n\n"
    f"Made by `bash scripts/peer-vllm-moe.sh {version}` on {datetime.date.today()} from {wheel.name} (sha256 "
    f"{digest}); {commit.strip()}.\n\n" + "\n".join(w.lstrip("# ") for w in where) +
    f"\n\nconfigs/: the release's {len(configs)} tuned JSON files of vllm/model_executor/layers/fused_moe/configs/.\n")
print(f"{dest}: {len(parts)} kernels, {len(configs)} configs (vLLM {version})")
EOF
git check-ignore -q "$dest/vllm_kernels.py" || { echo "$dest is not git-ignored: not leaving a peer's code there"; rm -rf "$dest"; exit 1; }

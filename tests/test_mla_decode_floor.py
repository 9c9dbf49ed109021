"""The floors the MLA benchmarks report, on stubs (no GPU): benchmarks/mla_decode.py's is the larger of the KV-read
and the tensor-core times (at 128 heads a bf16 cache is read-bound and an e4m3 one compute-bound on an H100), its
fraction `checks.share_of`'s; benchmarks/decode_step.py's step floor reads of a mixture of experts only the experts a
batch touches and of an untied embedding table only the batch's rows (issue 66: the default-mla step's "floor" at
batch 1 had exceeded the step)."""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
from decode_step import experts_touched, unread_weight_bytes  # noqa: E402
from mla_decode import decode_cost, floor_us  # noqa: E402

from tsdev_kernels.checks import Limits, limits_of, share_of  # noqa: E402


def test_the_mla_floor_is_the_larger_of_the_kv_read_and_the_tensor_core_time():
    h100 = limits_of("NVIDIA H100 80GB HBM3")
    bf16, e4m3 = decode_cost(64, 4096, 2), decode_cost(64, 4096, 1)
    assert bf16 == (64 * 4096 * 576 * 2, 2 * 128 * (576 + 512) * 64 * 4096) and e4m3[1] == bf16[1]
    read, tensor, floor = floor_us(*bf16, h100)
    assert read == bf16[0] / 3.0e12 * 1e6 and tensor == bf16[1] / 989e12 * 1e6 and floor == read > tensor
    read, tensor, floor = floor_us(*e4m3, h100)
    assert floor == tensor > read  # half the bytes, the same products
    share, bound = share_of(*e4m3, 2 * floor, h100)  # the benchmark's "of floor": floor / kernel time
    assert abs(share - 0.5) < 1e-12 and bound == "bf16 tensor cores"
    slow_cores = Limits("stub", bandwidth=1e12, bf16=1e12, fp8=2e12, source="stub")  # 1 FLOP per byte
    assert floor_us(100, 300, slow_cores) == (1e-4, 3e-4, 3e-4) and floor_us(300, 100, slow_cores)[2] == 3e-4


def test_a_steps_floor_reads_the_experts_its_batch_touches_and_the_embedding_rows_it_looks_up(tmp_path):
    from tsdev_runtime.config import ModelConfig
    from tsdev_runtime.models import MODELS, build_model
    from tsdev_runtime.weights.default_model import SHAPES

    config = {**SHAPES["tiny-mla"], "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
              "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model_config = ModelConfig.from_dir(tmp_path, MODELS)
    model = build_model(model_config, "cpu", torch.float32)
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    experts, top_k, width = config["n_routed_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]
    sparse = config["num_hidden_layers"] - config["first_k_dense_replace"]
    routed = sparse * experts * 3 * hidden * width * 4  # float32 gate, up and down of every routed expert
    for batch in (1, 3, 64):
        touched = experts * (1 - (1 - top_k / experts) ** batch)
        want = (vocab - batch) * hidden * 4 + routed * (1 - touched / experts)
        assert abs(unread_weight_bytes(model, model_config.raw, batch) - want) < 1e-3 * want
    assert experts_touched(experts, top_k, 1) == top_k and experts_touched(128, 8, 64) > 123


def test_a_tied_embedding_is_read_whole_and_a_dense_model_reads_every_weight(tmp_path):
    from tsdev_runtime.config import ModelConfig
    from tsdev_runtime.models import MODELS, build_model
    from tsdev_runtime.weights.default_model import SHAPES

    config = {**SHAPES["tiny"], "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
              "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model_config = ModelConfig.from_dir(tmp_path, MODELS)
    assert unread_weight_bytes(build_model(model_config, "cpu", torch.float32), model_config.raw, 1) == 0

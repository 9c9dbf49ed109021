"""A restart's weights handed over on a GPU (runtime/tsdev_runtime/weights/handover.py): the stopping server's CUDA
tensors reach the standby, another process, as IPC handles; it copies them device to device, answers, and its engine
serves them without reading the checkpoint -- the same tokens and checksum as the server that offered them."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tsdev_runtime.control_protocol import restart_marker
from tsdev_runtime.engine.sequence import SamplingParams
from tsdev_runtime.engine.sleep import weights_checksum
from tsdev_runtime.weights import handover

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79]]
ENGINE = dict(device="cuda", page_size=16, max_batched_tokens=256, max_running=16, kv_pages=64,
              cudagraph_capture_sizes=[1, 2])

STANDBY = """
import json, sys
from tsdev_runtime.weights import handover, loader
connection = handover.connect(sys.argv[1])
print("connected", flush=True)
received = handover.receive(connection, wait_s=120)
handover.hold(received)
loader._tensor_source = lambda *a, **k: sys.exit("the checkpoint was read")
from tsdev_runtime.config import EngineConfig
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.engine.sequence import SamplingParams
from tsdev_runtime.engine.sleep import weights_checksum
engine = LLMEngine(EngineConfig(model=sys.argv[2], **json.loads(sys.argv[3])))
tokens = [o["token_ids"] for o in engine.generate(json.loads(sys.argv[4]), SamplingParams(temperature=0.0,
                                                                                          max_tokens=12))]
print(json.dumps(dict(format=engine.runner.load_report.format, checksum=weights_checksum(engine.runner.model),
                      tokens=tokens)))
"""


def test_a_standby_process_serves_the_cuda_weights_the_stopping_server_handed_over(tiny_model_dir, tmp_path):
    from tsdev_runtime.config import EngineConfig
    from tsdev_runtime.engine.llm_engine import LLMEngine

    old = LLMEngine(EngineConfig(model=str(tiny_model_dir), **ENGINE))
    expected = [o["token_ids"] for o in old.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12))]
    checksum = weights_checksum(old.runner.model)
    path = str(tmp_path / "w.sock")
    listener = handover.Listener(path)
    Path(restart_marker(path)).touch()
    standby = subprocess.Popen([sys.executable, "-c", STANDBY, path, str(tiny_model_dir), json.dumps(ENGINE),
                                json.dumps(PROMPTS)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert standby.stdout.readline().strip() == "connected", standby.communicate(timeout=60)[1][-3000:]
    words = old.runner.offer_weights(listener, old.control.weights_loaded)  # (the standby copies meanwhile)
    stdout, stderr = standby.communicate(timeout=240)
    assert standby.returncode == 0, stderr[-3000:]
    assert " tensors copied by the standby in " in words and "one buffer of" in words, words  # packed
    served = json.loads(stdout.strip().splitlines()[-1])
    assert served["format"] == "handed over"
    assert served["checksum"] == checksum
    assert served["tokens"] == expected

"""Checkpoints that transformers itself writes, for the tests that take transformers as the oracle."""
import shutil
from pathlib import Path


def save_with_tiny_tokenizer(model, out: Path, tiny_model_dir: Path) -> Path:
    """`model.save_pretrained(out)`, with the tiny checkpoint's tokenizer (tokenizer.json, tokenizer_config.json)."""
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, out / name)
    return out

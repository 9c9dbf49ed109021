"""A model named as users name it: a checkpoint directory, or a Hugging Face hub id (`Qwen/Qwen3-0.6B`) found in
the local Hugging Face cache, offline. Nothing is ever downloaded: a hub id that is not in the cache is an error
that says where it looked and the command that would download it.

The cache layout is the one `hf download` (formerly `huggingface-cli download`) leaves:
`<cache>/models--ORG--NAME/refs/<revision>` holds a commit hash, `<cache>/models--ORG--NAME/snapshots/<hash>/` the
files (links into `blobs/`). The cache is `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`.
"""
import difflib
import os
import re
from collections.abc import Sequence
from pathlib import Path

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")


def hub_cache() -> Path:
    if cache := os.environ.get("HF_HUB_CACHE"):
        return Path(cache).expanduser()
    if home := os.environ.get("HF_HOME"):
        return Path(home).expanduser() / "hub"
    return Path("~/.cache/huggingface/hub").expanduser()


def is_hub_id(name: str) -> bool:
    """ORG/NAME that is not an existing path: what the hub cache is asked for."""
    return bool(HUB_ID.match(name)) and not Path(name).exists()


def not_a_model(name: str, embedded: Sequence[str] = ()) -> str:
    """Why `name` serves nothing (no such directory), naming the `embedded` models and the nearest of them."""
    elsewhere = "a Hugging Face checkpoint directory or a hub id (ORG/NAME) in the local Hugging Face cache"
    if not embedded:
        return f"{name} is not a directory: pass {elsewhere}"
    near = difflib.get_close_matches(name, embedded, n=1, cutoff=0.8)
    return (f"{name} is neither a directory nor a model embedded in tsdev ({', '.join(embedded)}): "
            f"{f'did you mean {near[0]}? Else pass' if near else 'pass'} one of those, {elsewhere}")


def resolve_model(name: str, revision: str | None = None, embedded: Sequence[str] = ()) -> Path:
    """The checkpoint directory `name` means: itself when it is a path, else the cached snapshot of hub id `name`
    at `revision` (a branch or tag name recorded in refs/, or a commit hash; default main). FileNotFoundError says
    what was looked for, where, and what to run (for a path that does not exist: the `embedded` models' names,
    the nearest first)."""
    if not is_hub_id(name):
        if revision is not None:
            raise ValueError(f"--revision {revision} applies to a Hugging Face hub id (ORG/NAME), not to the "
                             f"directory {name}")
        if not Path(name).exists():
            raise FileNotFoundError(not_a_model(name, embedded))
        return Path(name)
    repo = hub_cache() / f"models--{name.replace('/', '--')}"
    revision = revision or "main"
    ref = repo / "refs" / revision
    commit = revision if COMMIT.match(revision) else (ref.read_text().strip() if ref.is_file() else None)
    snapshot = repo / "snapshots" / commit if commit else None
    if snapshot is None or not snapshot.is_dir():
        cached = sorted(p.name for p in (repo / "snapshots").iterdir()) if (repo / "snapshots").is_dir() else []
        found = (f"; cached snapshots: {', '.join(cached)} (pass one with --revision)" if cached
                 else " (it holds no snapshot)" if repo.is_dir() else "")
        raise FileNotFoundError(
            f"{name} is not a directory, and revision {revision} of it is not in the Hugging Face cache: looked for "
            f"{ref if commit is None else snapshot}{found}. tsdev never downloads: run `hf download "
            f"{name}{'' if revision == 'main' else f' --revision {revision}'}` (or set HF_HUB_CACHE / HF_HOME to "
            "the cache that holds it), or pass a checkpoint directory")
    return snapshot

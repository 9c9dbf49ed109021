"""tsdev's cache directory, in one place for every floor (it imports nothing heavy: `tsdev history` reads the notebook
there without torch): $TSDEV_CACHE_DIR, else $XDG_CACHE_HOME/tsdev, else ~/.cache/tsdev. The embedded checkpoints,
`tsdev tune`'s files (`tuned/`) and the notebooks (`notebook/`) live under it."""
import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("TSDEV_CACHE_DIR")
                or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tsdev")

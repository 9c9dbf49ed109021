"""`tsdev watch`'s settings, and the plumbing that passes `tsdev serve` flags through it."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from tsdev.launch.child import local_url


@dataclass
class WatchConfig:
    model: str | None = None
    server_args: list[str] = field(default_factory=list)  # passed through to `tsdev serve`
    attach: str | None = None  # URL of a running server instead of a child
    host: str = "127.0.0.1"
    port: int = 8000
    project: Path = field(default_factory=Path.cwd)
    settle: float = 0.05
    probe_batch: int = 8
    probe_steps: int | None = None  # None: 128 on a GPU (32 moved ±15 % between restarts on the H200, 128 held
    # within ±1.2 %), 32 on the CPU (a step there takes milliseconds: 128 would hold each check a second)
    profile_each_reload: bool = False  # every reload's decode probe runs inside a capture range, not just after `p`
    server_log: Path | None = None
    startup_timeout: float = 600.0
    weights: Path | None = None  # --weights DIR: new checkpoints written there are loaded (update_weights, direct)
    api_key: str | None = field(default=None, repr=False)  # sent on every call; the started server gets it too
    notebook: bool = True  # each reload and restart recorded in the project's notebook (tsdev/notebook.py)

    @property
    def url(self) -> str:
        return (self.attach or local_url(self.host, self.port)).rstrip("/")

    @property
    def log_path(self) -> Path:
        return self.server_log or Path(os.environ.get("TMPDIR", "/tmp")) / f"tsdev-watch-{self.port}.log"


def serve_flags(command) -> dict[str, bool]:
    """{flag: takes a value} of a click command (`tsdev serve`), to pass its flags through watch."""
    return {opt: not param.is_flag for param in command.params if param.param_type_name == "option"
            for opt in (*param.opts, *param.secondary_opts)}


def split_server_args(tokens: list[str], flags: dict[str, bool]) -> tuple[str | None, list[str]]:
    """MODEL and the `tsdev serve` flags among watch's extra arguments (`flags`: flag -> takes a value)."""
    model, rest, i = None, [], 0
    while i < len(tokens):
        token = tokens[i]
        if token.startswith("-"):
            name = token.split("=", 1)[0]
            if name not in flags:
                raise ValueError(f"unknown option {name}: `tsdev watch --help` lists watch's own options and "
                                 "`tsdev serve --help` the server flags it passes on")
            rest.append(token)
            if flags[name] and "=" not in token and i + 1 < len(tokens):
                i += 1
                rest.append(tokens[i])
        elif model is None:
            model = token
        else:
            raise ValueError(f"unexpected argument {token!r}: give at most one MODEL")
        i += 1
    return model, rest

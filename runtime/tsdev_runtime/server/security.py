"""Who may call what: the server's access policy, in one place (docs/security.md).

Every request is sorted by its path, before routing, so a route added later is covered by default:

* open — `GET /health`, `GET /metrics` (unless `--metrics-require-api-key`): load balancers and Prometheus;
* OpenAI — `/v1/completions`, `/v1/chat/completions`, `/v1/models`: anyone who reaches the port;
* control — every other path (reload, pause, profile, events, server info, sleep/wake and the weight routes):
  only clients on this machine (loopback), unless an API key is set or `--allow-remote-control` is given.

With an API key (`--api-key`, `TSDEV_API_KEY`), every path but the open ones needs `Authorization: Bearer KEY`.
File paths that come in requests are confined to directories the server was given (`confine`).
"""
import hmac
import ipaddress
import json
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any, Literal

from tsdev_runtime.config import ServerConfig
from tsdev_runtime.control_protocol import ErrorBody, ErrorDetail

OPEN_PATHS = frozenset({"/health", "/metrics"})
OPENAI_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models"})
# Starlette's TestClient (in-process, no socket) calls its peer "testclient"; a TCP peer is always an address.
IN_PROCESS_CLIENT = "testclient"

Kind = Literal["open", "openai", "control"]
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class PathNotAllowed(ValueError):
    """A path from a request that leaves the directories the server may touch (answered 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SecurityPolicy:
    """What `tsdev serve`'s security flags set (ServerConfig), as the app applies it."""

    api_key: str | None = field(default=None, repr=False)
    allow_remote_control: bool = False
    metrics_require_api_key: bool = False
    profile_dir: Path = Path("profiles")  # /start_profile writes only under it
    allowed_weight_dirs: tuple[Path, ...] = ()  # weight paths may lie here, besides the served model's directory

    @classmethod
    def of(cls, server: ServerConfig) -> "SecurityPolicy":
        return cls(api_key=server.api_key or None, allow_remote_control=server.allow_remote_control,
                   metrics_require_api_key=server.metrics_require_api_key, profile_dir=Path(server.profile_dir),
                   allowed_weight_dirs=tuple(Path(d) for d in server.allowed_weight_dirs))

    def kind(self, path: str) -> Kind:
        if path in OPEN_PATHS and not (path == "/metrics" and self.metrics_require_api_key):
            return "open"
        return "openai" if path in OPENAI_PATHS else "control"

    def refusal(self, path: str, client_host: str | None, authorization: bytes | None,
                host_header: bytes | None = None, origin: bytes | None = None) -> tuple[int, str] | None:
        """(status, message) when this request may not run, None when it may."""
        kind = self.kind(path)
        if kind == "open":
            return None
        if self.api_key is not None:
            token = bearer_token(authorization)
            if token is None:
                return 401, (f"{path} needs this server's API key: send the header `Authorization: Bearer KEY` with "
                             "the key given to `tsdev serve --api-key` (or TSDEV_API_KEY); tsdev's clients take "
                             "--api-key or TSDEV_API_KEY, the openai client api_key=KEY")
            if not hmac.compare_digest(token, self.api_key.encode()):
                return 401, ("the API key sent (`Authorization: Bearer ...`) is not this server's: send the key "
                             "given to `tsdev serve --api-key` (or TSDEV_API_KEY)")
            return None
        if kind == "control" and not self.allow_remote_control and not is_local_client(client_host):
            return 403, (f"{path} is a control route and answers only clients on the server's machine (this request "
                         f"came from {client_host}): call it from that machine, or start the server with --api-key "
                         "KEY and send `Authorization: Bearer KEY` (or, on a trusted network only, "
                         "--allow-remote-control)")
        if kind == "control" and not self.allow_remote_control and client_host != IN_PROCESS_CLIENT:
            return browser_refusal(path, host_header, origin)
        return None

    def profile_target(self, output_dir: str | None, name: str | None) -> Path:
        """The directory a /start_profile range writes its trace into: the profile directory (--profile-dir), or
        `output_dir` as a subdirectory of it. `name` (the trace's file name, without .trace.json) is a plain name."""
        if name is not None and (name in ("", ".", "..") or any(c in name for c in "/\\\0")):
            raise PathNotAllowed(f"name {name!r} must be a plain file name (no /, \\ or ..): the trace is written "
                                 f"as NAME.trace.json in the server's profile directory", "name")
        if output_dir and (PurePath(output_dir).is_absolute() or ".." in PurePath(output_dir).parts):
            raise PathNotAllowed(f"output_dir {output_dir!r} must be a subdirectory name relative to the server's "
                                 f"profile directory (no absolute path, no ..): traces go under {self.profile_dir} "
                                 "(tsdev serve --profile-dir DIR chooses it)", "output_dir")
        remedy = "it leaves the server's profile directory (a symlink?): tsdev serve --profile-dir DIR chooses it"
        directory = confine(self.profile_dir / (output_dir or ""), [self.profile_dir], remedy, "output_dir")
        if directory.exists() and not directory.is_dir():
            raise PathNotAllowed(f"output_dir {output_dir!r} is a file in the server's profile directory, not a "
                                 "directory: name another subdirectory", "output_dir")
        if name:  # a symlink in place of the trace file would send the write elsewhere
            confine(directory / f"{name}.trace.json", [self.profile_dir], remedy, "name")
        return directory

    def code_path(self, path: str, roots: Sequence[Path]) -> Path:
        """A source file from compile_ahead's body (an editor's buffer): in one of the reloadable packages' `roots`. A
        relative path is taken from the server's working directory."""
        if not roots:
            raise PathNotAllowed("the server has imported no module of the reloadable packages: nothing can be "
                                 "compiled ahead", "path")
        return confine(Path.cwd() / path, roots,
                       "compile_ahead takes files of the reloadable packages (tsdev_kernels.ops, tsdev_runtime.layers, "
                       "... : [tool.tsdev] reload-packages); a save of any other file is reloaded, or restarts the "
                       "server, with nothing to build ahead", "path")

    def weight_path(self, path: str, model_dir: Path) -> Path:
        """A checkpoint path from a weight route's body (reload_weights, update_weights): under the served model's
        directory or an --allowed-weight-dir."""
        return confine(path, [Path(model_dir), *self.allowed_weight_dirs],
                       "pass a path under the served model's directory, or start the server with "
                       "--allowed-weight-dir DIR (repeatable)", "path")


def confine(path: str | PurePath, roots: Sequence[Path], remedy: str, param: str | None = None) -> Path:
    """`path` with symlinks and `..` resolved (a relative one taken from the first root), when it lies inside one
    of `roots` (resolved too); PathNotAllowed, saying which roots and `remedy`, otherwise."""
    resolved_roots = [Path(root).resolve() for root in roots]
    candidate = Path(path)
    resolved = (candidate if candidate.is_absolute() else resolved_roots[0] / candidate).resolve()
    if any(resolved.is_relative_to(root) for root in resolved_roots):
        return resolved
    where = ", ".join(str(root) for root in resolved_roots)
    raise PathNotAllowed(f"{path} resolves to {resolved}, outside {where}: {remedy}", param)


def bearer_token(authorization: bytes | None) -> bytes | None:
    """The token of an `Authorization: Bearer TOKEN` header (the scheme in any case), else None."""
    scheme, _, token = (authorization or b"").strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return token.strip() or None


def is_local_client(host: str | None) -> bool:
    """A client on this machine: a loopback address (127.0.0.0/8, ::1, ::ffff:127.x), a Unix socket (no address)
    or an in-process test client."""
    if host is None or host == IN_PROCESS_CLIENT:
        return True
    return _is_loopback_address(host)


def browser_refusal(path: str, host_header: bytes | None, origin: bytes | None) -> tuple[int, str] | None:
    """A loopback client may still be a browser acting for a web site: a cross-site request (an `Origin` that is
    not this machine) or DNS rebinding (a `Host` that is not a loopback name). Programs send neither."""
    remedy = ("without an API key, control routes answer programs on this machine (curl, tsdev) at "
              "http://127.0.0.1:PORT or http://localhost:PORT, not web pages; or start the server with --api-key KEY")
    if origin is not None and not is_loopback_host(_url_host(origin.decode("latin-1"))):
        return 403, f"{path}: refused a request sent by the web page {origin.decode('latin-1')!r}: {remedy}"
    if host_header is not None and not is_loopback_host(_url_host(host_header.decode("latin-1"))):
        return 403, (f"{path}: refused a request addressed to {host_header.decode('latin-1')!r}, not a loopback "
                     f"name (a DNS-rebinding web page?): {remedy}")
    return None


def _url_host(value: str) -> str:
    """The host of an Origin (`http://127.0.0.1:8000`) or Host (`[::1]:8000`) header value."""
    value = value.strip().split("://", 1)[-1].split("/", 1)[0]
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def is_loopback_host(host: str) -> bool:
    """Whether binding `host` keeps the server private to this machine (0.0.0.0, :: and LAN addresses do not)."""
    return host == "localhost" or _is_loopback_address(host)


def _is_loopback_address(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host.strip("[]").split("%")[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def startup_refusal(server: ServerConfig) -> str | None:
    """Why `tsdev serve` with these flags must not start (checked before the model loads), or None."""
    if server.allow_reload_forward and not server.api_key and not is_loopback_host(server.host):
        return (f"--allow-reload-forward on --host {server.host} would let any machine that reaches the port re-run "
                "this server's code from disk: add --api-key KEY (or set TSDEV_API_KEY), or serve on "
                "--host 127.0.0.1")
    if server.metrics_require_api_key and not server.api_key:
        return "--metrics-require-api-key needs an API key: add --api-key KEY (or set TSDEV_API_KEY)"
    return None


def describe(server: ServerConfig) -> str | None:
    """The banner's line on access, unless the server is the default one (private to this machine, no key)."""
    if server.api_key:
        return ("API key required (Authorization: Bearer) on every route but /health"
                + ("" if server.metrics_require_api_key else " and /metrics"))
    if server.allow_remote_control:
        return "no API key, and control routes answer any client (--allow-remote-control): trusted networks only"
    if not is_loopback_host(server.host):
        return (f"no API key: the OpenAI routes answer anyone who reaches {server.host}; control routes answer "
                "only this machine (--api-key KEY closes both)")
    return None


class Guard:
    """The policy as a pure ASGI middleware: refusals are answered before routing, parsing or the body limit.
    `disabled`: paths this server does not enable, with why (403 whatever the body: reload_forward without
    --allow-reload-forward)."""

    def __init__(self, app: Callable, policy: SecurityPolicy, disabled: dict[str, str] | None = None):
        self.app, self.policy, self.disabled = app, policy, disabled or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        path = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):  # what the router matches (starlette strips the mount point)
            path = path[len(root):] or "/"
        headers = dict(scope.get("headers", ()))  # names are lower case in ASGI
        client = scope.get("client")
        refused = self.policy.refusal(path, client[0] if client else None, headers.get(b"authorization"),
                                      headers.get(b"host"), headers.get(b"origin"))
        if refused is None and path in self.disabled:
            refused = 403, self.disabled[path]
        if refused is None:
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        status, message = refused
        kind = "authentication_error" if status == 401 else "permission_error"
        body = json.dumps(ErrorBody(error=ErrorDetail(message=message, type=kind, code=status)).dump()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b'Bearer realm="tsdev"'))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

"""The reward server: the rewards of a YAML config served over HTTP (``mmgrpo serve-rewards CONFIG``).

Use it to run a reward in another process, machine or Python environment (a large judge on its own GPUs, a reward
whose package conflicts with this project's dependencies) and score through the ``remote`` reward.

Wire format (version 2; JSON, with an optional binary part for arrays):

- ``GET /health`` -> ``{"status": "ok", "wire_version": 2, "rewards": [{"name", "kind", "modality", "weight"}]}``.
  The ``remote`` reward reads it once, before its first batch, and refuses a server of another version.
- ``POST /v1/score`` with a batch, as the JSON object::

      {"prompts": [B strings], "group": [B ints], "completions": [B strings] or null, "meta": [B objects],
       "images": ARRAY or null, "videos": ARRAY or null, "rewards": [names] or null (null = all),
       "request_id": string or null}

  ``request_id`` (optional, at most 128 characters) makes retries idempotent: a request whose id is among the last
  ``RECENT_REQUESTS`` ids the server received is not scored again but gets the answer of the first delivery (waiting
  for it while it is still being scored). A client that timed out while the server was scoring can so resend the
  batch without the server scoring it twice. Ids must be unique per batch (``remote`` sends a random UUID).

  ``images`` is (B, 3, H, W) and ``videos`` (B, T, 3, H, W); uint8 values mean value / 255, float values are in
  [0, 1]. Tensors inside ``meta`` travel as ``{"$array": ARRAY}`` and arrive as tensors of the same dtype; numpy
  scalars travel as JSON numbers and booleans.
  ``ARRAY`` is ``{"dtype": "uint8" | "float16" | "float32" | "float64" | "int32" | "int64" | "bool", "shape": [...]}``
  plus where its raw C-order little-endian bytes are, in one of two body layouts:

  - ``Content-Type: application/json``: the body is the object; each array has ``"data": base64 bytes``. Easy to
    write from any language.
  - ``Content-Type: application/x-mmgrpo-batch`` (what the ``remote`` reward sends): the body is the object on one
    line, a newline byte, then the bytes of all arrays back to back; each array has ``"offset"`` into those bytes.
    No base64 and no JSON escaping of megabytes: about 10x cheaper to encode and decode than the JSON layout
    (0.01 s against 0.10-0.14 s for 32 float16 images of 256 px at one thread on this project's 2-core CPU).
- The answer::

      {"names": [rewards run], "kinds": {name: "pointwise" | "groupwise"}, "main": {name: [B]},
       "scores": {"name" or "name/sub": [B]}, "seconds": {name: float}}

  ``main`` is the score that enters the combination (after the config's ``clip``; ``standardize`` belongs on the
  trainer's side, which sees the whole batch, and the server refuses it), ``scores``
  every raw score and sub-score; NaN travels as null.
- Errors are ``{"error": "one line"}`` with 400 (bad request, too deeply nested included), 401 (missing or wrong
  token), 404, 411/413 (no or too large a body) or 500 (a reward failed; the line names it).

Security: the server binds 127.0.0.1 by default (IPv6 addresses such as ``::1`` work too). Binding any address but a
loopback one requires a token (read from an environment variable, never from the config file); it refuses to start
without one. With a token, every request must carry ``Authorization: Bearer <token>`` (the scheme name in any case).

Concurrency: requests are decoded in their connection's thread and then scored one batch at a time, in arrival
order, by a single worker (so a client's requests are answered in the order it sent them and a reward model never
runs twice at once); within a batch the rewards run concurrently (see :class:`~mmgrpo.rewards.zoo.RewardZoo`).
"""

from __future__ import annotations

import base64
import hmac
import ipaddress
import json
import math
import os
import queue
import socket
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mmgrpo.config import (
    ConfigError,
    RewardSpec,
    _omegaconf_message,
    check_ranges,
    check_sections,
    ranged,
    read_preset,
)

from .base import RewardBatch
from .clip_models import one_line
from .zoo import RewardZoo

if TYPE_CHECKING:
    from typing_extensions import Self

WIRE_VERSION = 2
"""Version of the wire format below; 2 added ``request_id``."""
RECENT_REQUESTS = 64
"""How many request ids (with their answers) the server remembers to answer retries without scoring again."""
MAX_REQUEST_ID = 128
DEFAULT_PORT = 8765
DEFAULT_TOKEN_ENV = "MMGRPO_REWARD_TOKEN"
JSON_TYPE = "application/json"
BINARY_TYPE = "application/x-mmgrpo-batch"
DTYPES = {"uint8": torch.uint8, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64,
          "int32": torch.int32, "int64": torch.int64, "bool": torch.bool}
NAMES = {v: k for k, v in DTYPES.items()}


# ---------------------------------------------------------------------------------------------------- wire format
def encode_array(t: torch.Tensor, blobs: list[bytes] | None = None) -> dict[str, Any]:
    """A CPU copy of tensor ``t`` as an ``ARRAY`` object: its bytes appended to ``blobs`` (a binary request) and
    addressed by offset, or inline as base64 when ``blobs`` is None (a JSON request)."""
    if t.dtype not in NAMES:
        raise ValueError(f"cannot send a {t.dtype} tensor; use one of {sorted(DTYPES)}")
    array = t.detach().cpu().contiguous().numpy()
    raw = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
    obj: dict[str, Any] = {"dtype": NAMES[t.dtype], "shape": list(array.shape)}
    if blobs is None:
        obj["data"] = base64.b64encode(raw).decode("ascii")
    else:
        obj["offset"] = sum(len(b) for b in blobs)
        blobs.append(raw)
    return obj


def decode_array(obj: Any, where: str, blob: bytes = b"") -> torch.Tensor:
    """The tensor an ``ARRAY`` object holds (inline ``data``, or ``offset`` into ``blob``, the binary part of the
    request); ``ValueError`` naming ``where`` when it is malformed."""
    try:
        dtype = np.dtype(torch.empty(0, dtype=DTYPES[obj["dtype"]]).numpy().dtype).newbyteorder("<")
        shape = obj["shape"]
        if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
            raise ValueError(f"shape must be a list of sizes >= 0; got {shape!r}")
        count = math.prod(shape)
        if "data" in obj:
            array = np.frombuffer(base64.b64decode(obj["data"], validate=True), dtype=dtype)
        else:
            offset = int(obj["offset"])
            if not 0 <= offset <= len(blob) - count * dtype.itemsize:
                raise ValueError(f"bytes {offset}..{offset + count * dtype.itemsize} are outside the "
                                 f"{len(blob)}-byte binary part")
            array = np.frombuffer(blob, dtype=dtype, count=count, offset=offset)
        return torch.from_numpy(array.reshape(shape).copy())
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"bad array in {where}: {type(err).__name__}: {one_line(err, 160)}") from None


def encode_pixels(t: torch.Tensor | None, encoding: str, blobs: list[bytes] | None = None) -> dict[str, Any] | None:
    """Images or videos in [0, 1] as an ``ARRAY``: ``float16`` (error under 5e-4) or ``uint8`` (rounded, value/255,
    as a saved image; half of float16's bytes)."""
    if t is None:
        return None
    if encoding == "uint8":
        return encode_array((t.float().clamp(0, 1) * 255).round().to(torch.uint8), blobs)
    if encoding == "float16":
        return encode_array(t.to(torch.float16), blobs)
    raise ValueError(f"pixel encoding must be 'float16' or 'uint8'; got '{encoding}'")


def decode_pixels(obj: Any, where: str, ndim: int, blob: bytes = b"") -> torch.Tensor | None:
    """Float32 pixels in [0, 1] from an ``ARRAY`` of ``ndim`` dimensions (uint8 means value / 255)."""
    if obj is None:
        return None
    t = decode_array(obj, where, blob)
    if t.ndim != ndim:
        raise ValueError(f"{where} must have {ndim} dimensions; got shape {tuple(t.shape)}")
    return t.float() / 255 if t.dtype == torch.uint8 else t.float()


def encode_meta(value: Any, blobs: list[bytes] | None = None, where: str = "meta") -> Any:
    """``value`` with every tensor (or numpy array) replaced by ``{"$array": ARRAY}`` and every numpy scalar
    (``np.int64``, ``np.float32``, ``np.bool_``...) by the equal Python value; other values must be JSON."""
    for numpy_type, python_type in ((np.bool_, bool), (np.integer, int), (np.floating, float)):
        if isinstance(value, numpy_type):
            return python_type(value)
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    if torch.is_tensor(value):
        return {"$array": encode_array(value, blobs)}
    if isinstance(value, dict):
        return {str(k): encode_meta(v, blobs, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode_meta(v, blobs, f"{where}[{i}]") for i, v in enumerate(value)]
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    raise ValueError(f"{where} is a {type(value).__name__}; only JSON values and tensors can be sent")


def decode_meta(value: Any, blob: bytes = b"", where: str = "meta") -> Any:
    """The inverse of :func:`encode_meta`."""
    if isinstance(value, dict):
        if set(value) == {"$array"}:
            return decode_array(value["$array"], where, blob)
        return {k: decode_meta(v, blob, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, list):
        return [decode_meta(v, blob, f"{where}[{i}]") for i, v in enumerate(value)]
    return value


def encode_request(batch: RewardBatch, rewards: list[str] | None = None, encoding: str = "float16",
                   binary: bool = True, request_id: str | None = None) -> tuple[str, bytes]:
    """``(content_type, body)`` of the request scoring ``batch`` with the server rewards ``rewards`` (None = all):
    binary (arrays as raw bytes after the JSON line) or plain JSON (arrays inline as base64). ``request_id`` lets
    the server answer a resent copy without scoring it again."""
    blobs: list[bytes] | None = [] if binary else None
    header = {"prompts": list(batch.prompts), "group": [int(g) for g in batch.group.tolist()],
              "completions": None if batch.completions is None else list(batch.completions),
              "meta": encode_meta(list(batch.meta), blobs), "images": encode_pixels(batch.images, encoding, blobs),
              "videos": encode_pixels(batch.videos, encoding, blobs), "rewards": rewards,
              "request_id": request_id}
    head = json.dumps(header).encode("utf-8")
    if blobs is None:
        return JSON_TYPE, head
    return BINARY_TYPE, b"".join([head, b"\n", *blobs])


def decode_request(content_type: str, body: bytes) -> tuple[RewardBatch, list[str] | None, str | None]:
    """The batch, requested reward names and request id of a request body; ``ValueError`` / ``TypeError`` with one
    line when malformed (nested deeper than Python's recursion limit included)."""
    try:
        return _decode_request(content_type, body)
    except RecursionError:
        raise ValueError("the request is nested too deeply") from None


def _decode_request(content_type: str, body: bytes) -> tuple[RewardBatch, list[str] | None, str | None]:
    kind = content_type.split(";")[0].strip().lower()
    if kind == BINARY_TYPE:
        head, _, blob = body.partition(b"\n")
    elif kind == JSON_TYPE:
        head, blob = body, b""
    else:
        raise ValueError(f"Content-Type must be {JSON_TYPE} or {BINARY_TYPE}; got '{content_type}'")
    obj = json.loads(head)
    if not isinstance(obj, dict):
        raise TypeError("the request must be a JSON object")
    unknown = sorted(set(obj) - {"prompts", "group", "completions", "meta", "images", "videos", "rewards",
                                 "request_id"})
    if unknown:
        raise ValueError(f"unknown request fields {unknown}")
    if not isinstance(obj.get("prompts"), list) or not isinstance(obj.get("group"), list):
        raise TypeError("the request needs 'prompts' and 'group' lists")
    rewards = obj.get("rewards")
    if rewards is not None and not (isinstance(rewards, list) and all(isinstance(r, str) for r in rewards)):
        raise ValueError("'rewards' must be a list of reward names or null")
    request_id = obj.get("request_id")
    if request_id is not None and not (isinstance(request_id, str) and 0 < len(request_id) <= MAX_REQUEST_ID):
        raise ValueError(f"'request_id' must be a string of 1 to {MAX_REQUEST_ID} characters or null")
    try:
        group = torch.tensor(obj["group"], dtype=torch.int64)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError("'group' must be a list of integers") from None
    completions, meta = obj.get("completions"), obj.get("meta") or []
    if completions is not None and not (isinstance(completions, list) and all(isinstance(c, str) for c in completions)):
        raise ValueError("'completions' must be a list of strings or null")
    if not (isinstance(meta, list) and all(isinstance(m, dict) for m in meta)):
        raise ValueError("'meta' must be a list of objects")
    batch = RewardBatch(prompts=[str(p) for p in obj["prompts"]], group=group,
                        images=decode_pixels(obj.get("images"), "images", 4, blob),
                        videos=decode_pixels(obj.get("videos"), "videos", 5, blob),
                        completions=completions, meta=decode_meta(meta, blob))
    return batch, rewards, request_id


def scores_to_json(scores: torch.Tensor) -> list[float | None]:
    """(B,) scores as a JSON list, NaN as null."""
    return [None if math.isnan(v) else v for v in scores.tolist()]


def scores_from_json(values: list[float | None]) -> torch.Tensor:
    """The inverse of :func:`scores_to_json`: (B,) float64, null as NaN."""
    return torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float64)


# ---------------------------------------------------------------------------------------------------- config
@dataclass
class ServeOptions:
    """Where and how the reward server listens (the ``server:`` section of its config; CLI flags override)."""

    host: str = "127.0.0.1"
    """Address to bind: an IPv4 or IPv6 address (``::1``, ``::``) or a host name (served over IPv4). Anything but a
    loopback address (127.0.0.0/8, ``::1``, ``localhost``) requires a token."""
    port: int = ranged(DEFAULT_PORT, low=0, high=65535)
    """TCP port (0 = any free port)."""
    token_env: str = DEFAULT_TOKEN_ENV
    """Environment variable holding the bearer token; unset or empty = no token (loopback only)."""
    max_request_mb: float = 1024.0
    """Largest request body accepted, in MiB (413 beyond)."""


@dataclass
class ServerConfig:
    """A reward server config: the ``rewards:`` list, in the same format as in training presets, and options."""

    rewards: list[RewardSpec] = field(default_factory=list)
    """The rewards to serve; names must be distinct."""
    server: ServeOptions = field(default_factory=ServeOptions)
    """Listening options."""


def load_server_config(path: str | os.PathLike) -> ServerConfig:
    """Read a reward server config (``base:`` inheritance works as for presets); ``ConfigError`` names the key."""
    raw = read_preset(path)
    check_sections(raw, ServerConfig)  # names a reward item's key by its dotted path (rewards.1.weight)
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ServerConfig), raw))
    except OmegaConfBaseException as err:
        raise ConfigError(_omegaconf_message(err, ServerConfig)) from err
    if not cfg.rewards:
        raise ConfigError(f"missing required key 'rewards' in {path}: list at least one reward to serve")
    for i, spec in enumerate(cfg.rewards):
        if spec.name in ("", "???"):
            raise ConfigError(f"missing required key 'rewards.{i}.name'")
    check_ranges(cfg)
    return cfg


def bearer_token(token_env: str, owner: str = "remote") -> str:
    """The token in environment variable ``token_env`` without surrounding whitespace (a file's trailing newline),
    or "" when unset; ``ValueError`` starting with ``owner``, not echoing the token, when a control character is
    left (no header can hold it). Clients and the server read tokens alike, so a token that one accepts the other
    matches."""
    token = os.environ.get(token_env, "").strip()
    if any(ord(c) < 32 or ord(c) == 127 for c in token):
        raise ValueError(f"{owner}: the token in {token_env} holds a line break or another control character")
    return token


def bearer_matches(authorization: str, token: str) -> bool:
    """Whether an ``Authorization`` header value carries ``token`` as ``Bearer <token>``. The scheme's name is
    case-insensitive (RFC 7235) and may be followed by several spaces; the token must be exact and is compared in
    constant time."""
    scheme, _, sent = authorization.partition(" ")
    same = hmac.compare_digest(sent.lstrip(" ").encode("utf-8"), token.encode("utf-8"))
    return scheme.lower() == "bearer" and same


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost may resolve anywhere
        return False


def is_ipv6(host: str) -> bool:
    """True for an IPv6 address (``::1``, ``::``); False for IPv4 addresses and host names, served over IPv4."""
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets (``[::1]:8765``), as URLs write it."""
    return f"[{host}]:{port}" if is_ipv6(host) else f"{host}:{port}"


def check_bind(host: str, token: str | None, token_env: str) -> None:
    """Refuse (``ConfigError``) to serve on a non-loopback ``host`` without a token. Runs before anything binds."""
    if not token and not is_loopback(host):
        raise ConfigError(f"refusing to serve rewards on '{host}' without a token: set the environment variable "
                          f"{token_env} (clients send it as 'Authorization: Bearer ...'), or bind 127.0.0.1")


# ---------------------------------------------------------------------------------------------------- server
class BindError(OSError):
    """The server could not listen on its address (the port is taken, or the address is not this machine's)."""


class _Handler(BaseHTTPRequestHandler):
    """One HTTP request; the scoring itself goes through the server's queue."""

    server: _HTTPServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the default handler prints every request to stderr."""

    def _reply(self, status: int, obj: dict[str, Any]) -> None:
        body = json.dumps(obj).encode("utf-8")
        self.close_connection = True
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (timed out); its retry gets the answer
            pass

    def _refuse(self, status: int, message: str) -> None:
        """Answer an error before reading the body: the body (up to the size limit) is read and dropped first, so
        that the client gets the answer rather than a connection reset."""
        length = self.headers.get("Content-Length", "")
        remaining = min(int(length), self.server.owner.max_request_bytes) if length.isdigit() else 0
        while remaining > 0 and (chunk := self.rfile.read(min(2**20, remaining))):
            remaining -= len(chunk)
        self._reply(status, {"error": message})

    def _authorised(self) -> bool:
        token = self.server.owner.token
        if not token:
            return True
        if bearer_matches(self.headers.get("Authorization", ""), token):
            return True
        self._refuse(401, "missing or wrong token: send 'Authorization: Bearer <token>'")
        return False

    def do_GET(self) -> None:
        if not self._authorised():
            return
        if self.path.rstrip("/") != "/health":
            self._refuse(404, f"no such endpoint: GET {self.path} (try GET /health, POST /v1/score)")
            return
        self._reply(200, self.server.owner.health())

    def do_POST(self) -> None:
        if not self._authorised():
            return
        if self.path.rstrip("/") != "/v1/score":
            self._refuse(404, f"no such endpoint: POST {self.path} (try POST /v1/score)")
            return
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self._refuse(411, "send the request body with a Content-Length header")
            return
        limit = self.server.owner.max_request_bytes
        if int(length) > limit:
            self._refuse(413, f"request of {int(length)} bytes is over the limit of {limit} bytes")
            return
        try:
            batch, names, request_id = decode_request(self.headers.get("Content-Type", JSON_TYPE),
                                                      self.rfile.read(int(length)))
        except (ValueError, TypeError) as err:  # bad JSON, fields or arrays (UnicodeDecodeError is a ValueError)
            self._reply(400, {"error": f"bad request: {one_line(err)}"})
            return
        owner = self.server.owner
        unknown = sorted(set(names or []) - set(owner.zoo.names))
        if unknown:
            self._reply(400, {"error": f"this server has no reward {unknown}; it serves {owner.zoo.names}"})
            return
        try:
            answer = owner.score(batch, names, request_id)
        except Exception as err:  # noqa: BLE001 - a reward failed: tell the client which, keep serving
            self._reply(500, {"error": one_line(err)})
            return
        self._reply(200, answer)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    owner: RewardServer


class _HTTPServer6(_HTTPServer):
    address_family = socket.AF_INET6


class RewardServer:
    """Serves a :class:`RewardZoo` over HTTP (see the module notes for the wire format and security).

    ``start()`` serves from a background thread (tests, benchmarks); ``serve_forever()`` blocks (the CLI). Use it as a
    context manager to stop it reliably.

    Args:
        specs: the rewards (``RewardSpec``), built once here.
        host: address to bind, IPv4 or IPv6 (``::1``); a non-loopback address requires ``token``.
        port: TCP port; 0 picks a free one (see :attr:`url`).
        token: bearer token clients must send; None or empty = no authentication (loopback only).
        token_env: name of the variable the token came from, for the refusal message.
        max_request_mb: largest request body accepted, in MiB.
    """

    def __init__(self, specs: list[Any], host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                 token: str | None = None, token_env: str = DEFAULT_TOKEN_ENV, max_request_mb: float = 1024.0):
        check_bind(host, token, token_env)
        names = [s.name for s in specs]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ConfigError(f"reward server: rewards {duplicates} are configured twice; names must be distinct")
        standardized = [s.name for s in specs if (s.args or {}).get("standardize")]
        if standardized:
            raise ConfigError(f"reward server: 'standardize' of {standardized} needs the whole training batch, not "
                              "one request's; set it on the trainer's remote reward spec instead")
        self.token = token or None
        self.max_request_bytes = int(max_request_mb * 2**20)
        self.zoo = RewardZoo(specs)
        try:
            self._httpd = (_HTTPServer6 if is_ipv6(host) else _HTTPServer)((host, port), _Handler)
        except OSError as err:
            raise BindError(f"reward server: cannot listen on {host_port(host, port)}: {err.strerror or err}") from None
        self._httpd.owner = self
        self._jobs: queue.Queue = queue.Queue()
        self._recent: OrderedDict[str, Future] = OrderedDict()
        self._recent_lock = threading.Lock()
        self._worker = threading.Thread(target=self._work, name="reward-server-worker", daemon=True)
        self._worker.start()
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``http://host:port`` the server listens on (``http://[::1]:port`` for an IPv6 address)."""
        host, port = self._httpd.server_address[:2]
        return f"http://{host_port(host, port)}"

    def health(self) -> dict[str, Any]:
        """The ``GET /health`` answer."""
        rewards = [{"name": n, "kind": r.kind, "modality": r.modality, "weight": float(w)}
                   for n, r, w in zip(self.zoo.names, self.zoo.rewards, self.zoo.weights.tolist())]
        return {"status": "ok", "wire_version": WIRE_VERSION, "rewards": rewards}

    def score(self, batch: RewardBatch, names: list[str] | None, request_id: str | None = None) -> dict[str, Any]:
        """Queue ``batch`` for the worker and wait for its JSON answer (rewards ``names``, None = all). A
        ``request_id`` among the last ``RECENT_REQUESTS`` is not queued again: its first delivery's answer (or
        error) is returned, once ready."""
        with self._recent_lock:
            job = self._recent.get(request_id) if request_id else None
            if job is None:
                job = Future()
                self._jobs.put((batch, names, job))
                if request_id:
                    self._recent[request_id] = job
                    if len(self._recent) > RECENT_REQUESTS:
                        self._recent.popitem(last=False)
        return job.result()

    def _work(self) -> None:
        while (item := self._jobs.get()) is not None:
            batch, names, job = item
            try:
                main, logged, seconds = self.zoo(batch, only=names)
                run = [n for n in self.zoo.names if names is None or n in names]
                kinds = {n: r.kind for n, r in zip(self.zoo.names, self.zoo.rewards) if n in run}
                job.set_result({"names": run, "kinds": kinds,
                                "main": {n: scores_to_json(main[:, i]) for i, n in enumerate(run)},
                                "scores": {k: scores_to_json(v) for k, v in logged.items()},
                                "seconds": seconds})
            except Exception as err:  # noqa: BLE001 - handed to the request's thread, which answers 500
                job.set_exception(err)

    def start(self) -> RewardServer:
        """Serve from a background thread; returns self."""
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), name="reward-server",
                                        daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve in this thread until interrupted (Ctrl-C), then stop."""
        try:
            self._httpd.serve_forever()
        finally:
            self.stop()

    def stop(self) -> None:
        """Stop accepting requests, release the port and end the worker after the queued batches."""
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()
        self._jobs.put(None)
        self._worker.join()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(config: str | os.PathLike, host: str | None = None, port: int | None = None,
          token_env: str | None = None) -> RewardServer:
    """A :class:`RewardServer` for the config file ``config``; ``host`` / ``port`` / ``token_env`` override its
    ``server:`` section. Not started."""
    cfg = load_server_config(config)
    opts = cfg.server
    host = opts.host if host is None else host
    token_env = opts.token_env if token_env is None else token_env
    try:
        token = bearer_token(token_env, "reward server") or None
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return RewardServer(cfg.rewards, host=host, port=opts.port if port is None else port, token=token,
                        token_env=token_env, max_request_mb=opts.max_request_mb)

"""The ``remote`` reward: scores through a reward server (``mmgrpo serve-rewards``, :mod:`.server`).

Also the small JSON-over-HTTP client (standard library only) that it and the OpenAI-compatible judge backend share:
timeouts, retries with exponential backoff (or the server's ``Retry-After``), and one-line errors that name the URL.
"""

from __future__ import annotations

import datetime
import email.utils
import http.client
import json
import math
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
import warnings
from typing import Any

import torch

from mmgrpo.registry import REWARDS

from .base import GROUPWISE, POINTWISE, Reward, RewardBatch
from .clip_models import one_line
from .server import (
    DEFAULT_TOKEN_ENV,
    JSON_TYPE,
    WIRE_VERSION,
    bearer_token,
    encode_request,
    is_loopback,
    scores_from_json,
)

RETRY_STATUS = (429, 502, 503, 504)
"""HTTP answers worth retrying: rate limited, or a proxy / server that is (re)starting or overloaded."""
TOO_LARGE = 413
"""HTTP answer to a request over the server's size limit: the remote reward sends it again in halves."""
MAX_BACKOFF = 30.0
"""Longest wait before a retry, in seconds: the doubled backoff and a server's ``Retry-After`` alike."""
FAILURE_POLICIES = ("error", "nan")
# loopback traffic never goes through a proxy from the environment
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class RemoteError(RuntimeError):
    """An HTTP request that failed for good; ``str()`` is one line that names the URL. ``status`` is the HTTP status
    of the answer that ended it; None when there was none (no connection, a timeout) or the answer was unusable."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class RemoteRefused(RemoteError):
    """The reward server refused a request in a way every later request would be refused too (a rejected token, a
    wrong URL or reward, a request it cannot read, a single sample over its size limit): never scored NaN."""


class WireVersionError(RuntimeError):
    """The reward server speaks another wire version than this client: not retried, and never scored NaN."""


def request_json(url: str, payload: Any = None, *, body: bytes | None = None, content_type: str = JSON_TYPE,
                 headers: dict[str, str] | None = None, timeout: float = 60.0, retries: int = 3,
                 backoff: float = 0.5) -> Any:
    """GET ``url``, or POST ``payload`` as JSON (or a ready ``body`` of ``content_type``); the decoded JSON answer.

    Connection failures, timeouts and 429/502/503/504 answers are retried ``retries`` times, waiting ``backoff``
    seconds, doubled after each attempt (at most 30 s); when such an answer carries ``Retry-After``, the next attempt
    waits that long instead, at most ``timeout`` and 30 s. Other HTTP errors and undecodable answers fail at once.
    ``timeout`` is the socket timeout of each attempt. Raises :class:`RemoteError` (with the HTTP ``status``)."""
    if payload is not None:
        body = json.dumps(payload).encode("utf-8")
    method = "GET" if body is None else "POST"
    head = {"Accept": JSON_TYPE, **({} if body is None else {"Content-Type": content_type}), **(headers or {})}
    opener = _DIRECT if is_loopback(urllib.parse.urlsplit(url).hostname or "") else urllib.request.build_opener()
    problem, status, wait = "", None, None
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(min(backoff * 2 ** (attempt - 1) if wait is None else wait, MAX_BACKOFF))
        try:
            with opener.open(urllib.request.Request(url, data=body, headers=head, method=method),
                             timeout=timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as err:
            status, problem = err.code, f"HTTP {err.code}: {_error_text(err)}"
            if err.code not in RETRY_STATUS:
                raise RemoteError(f"{method} {url} failed: {problem}", status) from None
            wait = retry_after_seconds(err.headers.get("Retry-After") if err.headers else None)
            wait = None if wait is None else min(wait, timeout)
            continue
        except (OSError, http.client.HTTPException) as err:  # refused, reset, timed out (URLError is an OSError)
            problem, status, wait = f"{type(err).__name__}: {one_line(getattr(err, 'reason', err), 200)}", None, None
            continue
        try:
            return json.loads(raw)
        except ValueError:
            raise RemoteError(f"{method} {url} answered something that is not JSON: "
                              f"{one_line(raw[:200].decode('utf-8', 'replace'))}") from None
    raise RemoteError(f"{method} {url} failed after {retries + 1} attempts: {problem}", status)


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """The wait in seconds a ``Retry-After`` header asks for: a number of seconds (fractions accepted) or an HTTP
    date (0 when past; ``now`` is the current Unix time, default the clock's). None when absent or unreadable."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            date = email.utils.parsedate_to_datetime(value.strip())
        except (TypeError, ValueError, IndexError):
            return None
        if date.tzinfo is None:  # "-0000": UTC as well
            date = date.replace(tzinfo=datetime.timezone.utc)
        return max(0.0, date.timestamp() - (time.time() if now is None else now))
    return seconds if 0 <= seconds < math.inf else None


def is_setup_mistake(status: int | None) -> bool:
    """Whether an HTTP answer is one that every later request would get too, so retrying or scoring NaN only hides
    it: a 4xx (400 bad request, 401/403 token, 404 URL, 422 shape...) but 408 (timed out), 413 (the request can be
    split) and 429 (rate limited)."""
    return status is not None and 400 <= status < 500 and status not in (408, TOO_LARGE, 429)


def _error_text(err: urllib.error.HTTPError) -> str:
    """The ``error`` line of a JSON error body, else the start of the body."""
    try:
        raw = err.read()
    except OSError:
        return err.reason
    try:
        return one_line(json.loads(raw)["error"], 300)
    except (ValueError, KeyError, TypeError):
        return one_line(raw[:300].decode("utf-8", "replace")) or str(err.reason)


def group_chunks(group: torch.Tensor, max_batch: int) -> list[list[int]]:
    """Rows of ``group`` (B,) split into chunks of at most ``max_batch`` rows that never split a group (a group
    larger than ``max_batch`` is a chunk of its own). Groups keep their order of first appearance."""
    rows: dict[int, list[int]] = {}
    for row, gid in enumerate(group.tolist()):
        rows.setdefault(gid, []).append(row)
    chunks: list[list[int]] = []
    for members in rows.values():
        if chunks and len(chunks[-1]) + len(members) <= max_batch:
            chunks[-1].extend(members)
        else:
            chunks.append(list(members))
    return chunks


def halves(rows: list[int], group: list[int] | None = None) -> list[list[int]]:
    """``rows`` of a batch in two halves, for a request the server found too large: by samples, or, given the
    rows' ``group`` ids, by whole groups (a groupwise reward must see whole groups). Empty when they cannot be split
    (one sample; one group)."""
    if group is None:
        units = [[row] for row in rows]
    else:
        by_group: dict[int, list[int]] = {}
        for row, gid in zip(rows, group, strict=True):
            by_group.setdefault(gid, []).append(row)
        units = list(by_group.values())
    if len(units) < 2:
        return []
    middle = len(units) // 2
    return [[row for unit in units[:middle] for row in unit], [row for unit in units[middle:] for row in unit]]


@REWARDS.register("remote", kind=POINTWISE, modality="any",
                  description="a reward served by `mmgrpo serve-rewards`, scored over HTTP in batches")
class RemoteReward(Reward):
    """A reward of a reward server. Returns the server reward's main score, plus its sub-scores when it has any
    (as ``score`` and the sub-score names).

    The batch is sent in requests of at most ``max_batch`` samples that hold whole groups, so groupwise server
    rewards see whole groups. A request the server finds too large (413) is sent again in two halves, recursively,
    down to one sample (one group for a groupwise reward). Images and videos travel in memory as ``encoding``
    arrays (see :mod:`.server`). Each request carries a random ``request_id``, so a retry after a timeout is answered
    from the server's first scoring of it, not scored twice. Before its first request the reward reads the server's
    ``/health`` (with the same retries) and raises :class:`WireVersionError` if the server speaks another wire
    version.

    Args:
        url: the server's base URL, ``http://host:port``.
        reward: the server reward to use; None = the server's only reward.
        kind: ``pointwise`` or ``groupwise``, as the server reward is (checked against the server's answer).
        max_batch: most samples per request (a group larger than this is sent alone).
        timeout: socket timeout of each request, in seconds.
        retries: extra attempts after a connection failure, a timeout or a 429/502/503/504 answer.
        backoff: seconds before the first retry, doubled after each attempt (at most 30 s); a ``Retry-After`` in
            the answer replaces it (at most ``timeout`` and 30 s).
        on_failure: ``error`` raises a one-line error naming the URL; ``nan`` scores the samples of failed
            requests NaN ("does not apply"), in the main score and every sub-score the server reward has returned
            so far (so the reward's output keeps its names), and warns (``failed_requests`` counts them). Under
            both, a setup mistake (:func:`is_setup_mistake`: a rejected token, a wrong URL or reward...) and a
            single sample over the server's size limit raise :class:`RemoteRefused` at once.
        token_env: environment variable holding the server's token, sent as ``Authorization: Bearer`` when set
            (surrounding whitespace dropped).
        encoding: pixels on the wire, ``float16`` or ``uint8``.
    """

    modality = "any"

    def __init__(self, url: str, reward: str | None = None, kind: str = POINTWISE, max_batch: int = 32,
                 timeout: float = 300.0, retries: int = 4, backoff: float = 0.5, on_failure: str = "error",
                 token_env: str = DEFAULT_TOKEN_ENV, encoding: str = "float16"):
        if kind not in (POINTWISE, GROUPWISE):
            raise ValueError(f"remote: kind must be '{POINTWISE}' or '{GROUPWISE}'; got '{kind}'")
        if on_failure not in FAILURE_POLICIES:
            raise ValueError(f"remote: on_failure must be one of {FAILURE_POLICIES}; got '{on_failure}'")
        if encoding not in ("float16", "uint8"):
            raise ValueError(f"remote: encoding must be 'float16' or 'uint8'; got '{encoding}'")
        if max_batch < 1 or retries < 0 or timeout <= 0 or backoff < 0:
            raise ValueError("remote: needs max_batch >= 1, retries >= 0, timeout > 0 and backoff >= 0")
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"remote: url must be http://host:port or https://host:port; got {url!r}")
        self.url = url.rstrip("/")
        self.reward, self.kind, self.max_batch = reward, kind, int(max_batch)
        self.timeout, self.retries, self.backoff = float(timeout), int(retries), float(backoff)
        self.on_failure, self.encoding = on_failure, encoding
        token = bearer_token(token_env)
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.failed_requests = 0
        self.version_checked = False
        self.score_names = ["score"]
        """The names of the server reward's scores seen so far (``score`` first), which a failed call returns."""

    def _check_version(self) -> None:
        """The server's ``GET /health`` must report this client's ``WIRE_VERSION`` (checked once)."""
        health = request_json(f"{self.url}/health", headers=self.headers, timeout=self.timeout,
                              retries=self.retries, backoff=self.backoff)
        version = health.get("wire_version") if isinstance(health, dict) else None
        if version != WIRE_VERSION:
            raise WireVersionError(f"remote: the server at {self.url} speaks reward wire version {version!r} and this "
                                   f"client {WIRE_VERSION}: run the same mmgrpo version on both sides")
        self.version_checked = True

    def _request(self, batch: RewardBatch) -> dict[str, torch.Tensor]:
        """One request: ``{"score": main, sub: ...}`` for ``batch``."""
        if not self.version_checked:
            self._check_version()
        endpoint = f"{self.url}/v1/score"
        content_type, body = encode_request(batch, None if self.reward is None else [self.reward], self.encoding,
                                            request_id=uuid.uuid4().hex)
        answer = request_json(endpoint, body=body, content_type=content_type, headers=self.headers,
                              timeout=self.timeout, retries=self.retries, backoff=self.backoff)
        try:
            names, kinds = answer["names"], answer["kinds"]
            name = names[0] if isinstance(names, list) and len(names) == 1 else None
            kind = None if name is None else kinds[name]
            out = {} if name is None else {"score": scores_from_json(answer["main"][name])}
            for key, values in ({} if name is None else answer["scores"]).items():
                if key.startswith(f"{name}/") and key != f"{name}/score":
                    out[key[len(name) + 1:]] = scores_from_json(values)
        except (KeyError, TypeError, ValueError, AttributeError) as err:  # not a mapping, scores not numbers...
            raise RemoteError(f"POST {endpoint} answered a malformed reply ({type(err).__name__}: {one_line(err)}): "
                              "is it a reward server?") from None
        if self.reward is not None and names != [self.reward]:
            raise RemoteError(f"POST {endpoint} answered for reward {names}, not the '{self.reward}' it was asked for")
        if name is None:
            raise ValueError(f"remote: the server at {self.url} serves {names}; name one with reward=...")
        if kind != self.kind:
            raise ValueError(f"remote: '{name}' at {self.url} is {kind} but this reward says kind={self.kind}; "
                             f"set kind: {kind}")
        for key, values in out.items():
            if values.numel() != len(batch):
                raise RemoteError(f"POST {endpoint} answered {values.numel()} values of '{key}' for {len(batch)} samples")
        return out

    def _score(self, batch: RewardBatch, rows: list[int], parts: list[tuple[list[int], dict[str, torch.Tensor]]],
               failed: list[str]) -> None:
        """Append ``(rows, scores)`` of ``rows`` of ``batch`` to ``parts``, in requests of halves while the server
        finds them too large; a failed request's message to ``failed`` under on_failure=nan, else it raises."""
        try:
            whole = rows == list(range(len(batch)))  # the batch as it is (rows are grouped, not sorted)
            parts.append((rows, self._request(batch if whole else batch.select(rows))))
            return
        except RemoteError as err:
            error = err
        if error.status == TOO_LARGE:
            group = batch.group.tolist()
            split = halves(rows, [group[row] for row in rows] if self.kind == GROUPWISE else None)
            for half in split:
                self._score(batch, half, parts, failed)
            if split:
                return
        label = f"remote reward {repr(self.reward) if self.reward else '(the only one served)'} at {self.url}"
        if error.status == TOO_LARGE:
            unit = "group" if self.kind == GROUPWISE else "sample"
            raise RemoteRefused(f"{label}: {error} (even a single {unit} is too large for the server: raise its "
                                "max_request_mb, or send smaller pixels with encoding: uint8)", error.status)
        if is_setup_mistake(error.status):
            raise RemoteRefused(f"{label}: {error} (a setup mistake: not retried, whatever on_failure says)",
                                error.status)
        if self.on_failure == "error":
            raise error
        self.failed_requests += 1
        failed.append(str(error))

    def __call__(self, batch: RewardBatch) -> torch.Tensor | dict[str, torch.Tensor]:
        """The server's scores for ``batch``: one tensor, or a dict when the server reward has sub-scores."""
        parts: list[tuple[list[int], dict[str, torch.Tensor]]] = []
        failed: list[str] = []
        for rows in group_chunks(batch.group, self.max_batch):
            self._score(batch, rows, parts, failed)
        if failed:
            warnings.warn(f"remote reward: {len(failed)} request(s) failed, their samples score NaN: {failed[0]}",
                          RuntimeWarning, stacklevel=2)
        self.score_names = keys = list(dict.fromkeys([*self.score_names, *(k for _, part in parts for k in part)]))
        out = {k: torch.full((len(batch),), math.nan, dtype=torch.float64) for k in keys}
        for rows, part in parts:
            index = torch.tensor(rows)
            for key, values in part.items():
                out[key][index] = values
        return out["score"] if keys == ["score"] else out

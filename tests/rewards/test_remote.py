"""The remote reward against a canned reward server on loopback: replies that do not fit the request, HTTP errors
that are setup mistakes, requests too large for the server, and Retry-After."""

import json
import time
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler

import pytest
import torch

from mmgrpo.config import RewardSpec
from mmgrpo.errors import RunError
from mmgrpo.rewards import RewardBatch, RewardZoo
from mmgrpo.rewards.remote import RemoteError, RemoteRefused, RemoteReward, retry_after_seconds
from mmgrpo.rewards.server import decode_request


def two_samples():
    return RewardBatch(prompts=["a", "b"], group=torch.zeros(2, dtype=torch.long))


def test_a_sub_score_of_the_wrong_length_is_named(canned_server):
    """The main score has 2 values, the sub-score 'extra' 3: the error names 'extra' and its 3 values (it said
    '2 scores for 2 samples', which is no mismatch at all)."""
    url, reply = canned_server
    reply["score"] = {"names": ["x"], "kinds": {"x": "pointwise"}, "main": {"x": [1.0, 2.0]},
                      "scores": {"x/score": [1.0, 2.0], "x/extra": [1.0, 2.0, 3.0]}}
    with pytest.raises(RemoteError, match=r"^POST .*/v1/score answered 3 values of 'extra' for 2 samples$"):
        RemoteReward(url, retries=0)(two_samples())
    reply["score"]["main"]["x"] = [1.0]
    with pytest.raises(RemoteError, match=r"answered 1 values of 'score' for 2 samples$"):
        RemoteReward(url, retries=0)(two_samples())


def test_a_reply_for_another_reward_than_the_one_asked_is_refused(canned_server):
    """Asked for 'a', answered for 'b' (a wrong URL, another server on the port): the scores are not taken as
    'a''s; under on_failure=nan the samples score NaN."""
    url, reply = canned_server
    reply["score"] = {"names": ["b"], "kinds": {"b": "pointwise"}, "main": {"b": [1.0, 2.0]}, "scores": {}}
    with pytest.raises(RemoteError, match=r"answered for reward \['b'\], not the 'a' it was asked for"):
        RemoteReward(url, reward="a", retries=0)(two_samples())
    remote = RemoteReward(url, reward="a", retries=0, on_failure="nan")
    with pytest.warns(RuntimeWarning, match="their samples score NaN"):
        assert remote(two_samples()).isnan().all()
    assert RemoteReward(url, retries=0)(two_samples()).tolist() == [1.0, 2.0]  # no reward named: the only one


def test_a_token_read_with_its_trailing_newline_is_sent_without_it(canned_server, monkeypatch):
    """A token from a file often ends in a newline, which no HTTP header may hold: it raised 'Invalid header value
    b'Bearer <the token>\\n'' on every request (the secret in the log), escaping on_failure=nan. Surrounding
    whitespace is dropped; a token with a line break inside is refused at construction without echoing it."""
    url, reply = canned_server
    reply["score"] = {"names": ["x"], "kinds": {"x": "pointwise"}, "main": {"x": [1.0, 2.0]}, "scores": {}}
    monkeypatch.setenv("TEST_REMOTE_TOKEN", "s3cret\n")
    assert RemoteReward(url, retries=0, token_env="TEST_REMOTE_TOKEN")(two_samples()).tolist() == [1.0, 2.0]
    assert reply["auth"] == ["Bearer s3cret", "Bearer s3cret"]  # /health, then /v1/score
    monkeypatch.setenv("TEST_REMOTE_TOKEN", "s3c\nret")
    with pytest.raises(ValueError, match="^remote: the token in TEST_REMOTE_TOKEN holds a line break or another "
                                         "control character") as info:
        RemoteReward(url, token_env="TEST_REMOTE_TOKEN")
    assert "s3c" not in str(info.value)


def test_interleaved_groups_in_one_request_keep_each_sample_its_score():
    """Groups [0, 1, 0, 1] fit one request: the whole batch is sent in its own order, so its scores go back to
    rows 0..3 in that order (they went to the chunk's group-sorted rows 0, 2, 1, 3: samples 1 and 2 swapped)."""
    from mmgrpo.config import RewardSpec
    from mmgrpo.rewards import build_reward
    from mmgrpo.rewards.server import RewardServer

    stripes = (torch.arange(8) % 2).view(1, 1, 1, 8) * torch.tensor([16.0, 32, 64, 128]).view(4, 1, 1, 1)
    images = stripes.expand(4, 3, 8, 8) / 256  # multiples of 1/256: exact in float16 on the wire
    batch = RewardBatch(prompts=["p"] * 4, group=torch.tensor([0, 1, 0, 1]), images=images)
    local = build_reward("sharpness", {})(batch)
    assert len(set(local.tolist())) == 4
    with RewardServer([RewardSpec(name="sharpness")], port=0).start() as server:
        remote = RemoteReward(server.url, reward="sharpness", encoding="float16")(batch)
    assert torch.equal(remote, local), (remote, local)


@pytest.fixture
def scripted_server(serve):
    """A loopback reward server serving one reward 'x' that scores each prompt as the number it holds. ``/health``
    is right. ``POST /v1/score`` first answers the ``(status, headers)`` pairs of ``state["script"]`` in turn (with
    a JSON error line), then refuses with 413 a batch over ``state["limit"]`` samples, else scores it.
    ``state["posts"]`` logs ``(time, prompts, group ids)`` of every POST; ``state["kind"]`` is the reward's kind."""
    state = {"script": [], "limit": 10**9, "posts": [], "kind": "pointwise"}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, status, obj, headers=()):
            body = json.dumps(obj).encode()
            self.send_response(status)
            for key, value in headers:
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self._send(200, {"status": "ok", "wire_version": 2})

        def do_POST(self):
            batch, _, _ = decode_request(self.headers["Content-Type"],
                                         self.rfile.read(int(self.headers["Content-Length"])))
            state["posts"].append((time.perf_counter(), list(batch.prompts), batch.group.tolist()))
            if state["script"]:
                status, headers = state["script"].pop(0)
                self._send(status, {"error": f"scripted {status}"}, headers.items())
            elif len(batch) > state["limit"]:
                self._send(413, {"error": f"{len(batch)} samples is over the limit of {state['limit']}"})
            else:
                values = [float(p) for p in batch.prompts]
                self._send(200, {"names": ["x"], "kinds": {"x": state["kind"]}, "main": {"x": values},
                                 "scores": {"x/score": values}})

    return serve(Handler), state


def numbered(values, group):
    """A batch whose prompts are ``values`` (the scripted server's scores) with group ids ``group``."""
    return RewardBatch(prompts=[str(v) for v in values], group=torch.tensor(group))


@pytest.mark.parametrize("status", [400, 401, 403, 404, 422])
def test_a_setup_mistake_stops_the_run_whatever_on_failure_says(scripted_server, status):
    """A rejected token, a wrong URL or reward, a request the server cannot read: every request of the run gets the
    same answer, so on_failure=nan scored every step NaN and the run trained for hours on nothing. Now it stops at
    the first answer (not retried) with one line naming the URL, the status and the reward, also through the zoo
    (a RunError: the trainer's one-line stop)."""
    url, state = scripted_server
    state["script"] = [(status, {})] * 3
    remote = RemoteReward(url, reward="x", on_failure="nan", retries=3, backoff=5.0)
    start = time.perf_counter()
    with pytest.raises(RemoteRefused, match=f"^remote reward 'x' at {url}: POST {url}/v1/score failed: HTTP {status}: "
                                            f"scripted {status} \\(a setup mistake: not retried, whatever on_failure "
                                            "says\\)$"):
        remote(numbered([1, 2], [0, 0]))
    assert time.perf_counter() - start < 4.0 and len(state["posts"]) == 1 and remote.failed_requests == 0
    zoo = RewardZoo([RewardSpec(name="remote", args={"url": url, "reward": "x", "on_failure": "nan"})])
    with pytest.raises(RunError, match=f"reward 'remote' failed: RemoteRefused: .*HTTP {status}: scripted"):
        zoo(numbered([1, 2], [0, 0]))


def test_transient_failures_keep_retrying_then_the_policy(scripted_server):
    """503, 500 and a wrong reply are no setup mistakes: 503 is retried, and under on_failure=nan the samples of
    a request that failed for good score NaN while the other requests are scored."""
    url, state = scripted_server
    state["script"] = [(503, {}), (503, {}), (500, {})]
    remote = RemoteReward(url, reward="x", on_failure="nan", retries=1, backoff=0.01, max_batch=2)
    with pytest.warns(RuntimeWarning, match="2 request\\(s\\) failed, their samples score NaN: .*HTTP 503"):
        scores = remote(numbered([1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 2, 2]))
    assert scores[:4].isnan().all() and scores[4:].tolist() == [5.0, 6.0] and len(state["posts"]) == 4


def test_a_request_too_large_for_the_server_is_split_in_halves(scripted_server):
    """The server refuses more than 2 samples (413): the request of 7 is sent again as 3 + 4, then 1 + 2 and
    2 + 2, and every sample gets its own score back, in the batch's order (interleaved groups too)."""
    url, state = scripted_server
    state["limit"] = 2
    batch = numbered([10, 11, 12, 13, 14, 15, 16], [0, 1, 0, 1, 2, 2, 3])
    remote = RemoteReward(url, reward="x", retries=0)
    assert remote(batch).tolist() == [10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 16.0]
    assert [len(prompts) for _, prompts, _ in state["posts"]] == [7, 3, 1, 2, 4, 2, 2]
    assert remote.failed_requests == 0
    state["limit"], state["posts"] = 0, []  # not even one sample fits: a setup mistake, named
    for policy in ("error", "nan"):
        with pytest.raises(RemoteRefused, match=f"^remote reward 'x' at {url}: POST {url}/v1/score failed: HTTP 413: "
                                                "1 samples is over the limit of 0 \\(even a single sample"):
            RemoteReward(url, reward="x", retries=0, on_failure=policy)(numbered([1, 2], [0, 0]))
    assert [len(prompts) for _, prompts, _ in state["posts"]] == [2, 1] * 2  # stopped at the first single sample


def test_a_groupwise_request_too_large_is_split_between_groups(scripted_server):
    """A groupwise server reward must see whole groups: the halves hold whole groups, and a single group that is
    still too large is refused (not split into a partial group, which would score other values)."""
    url, state = scripted_server
    state["kind"], state["limit"] = "groupwise", 5
    batch = numbered(list(range(8)), [0, 0, 1, 1, 2, 2, 3, 3])
    assert RemoteReward(url, reward="x", kind="groupwise", retries=0)(batch).tolist() == list(map(float, range(8)))
    assert [group for _, _, group in state["posts"]] == [[0, 0, 1, 1, 2, 2, 3, 3], [0, 0, 1, 1], [2, 2, 3, 3]]
    state["limit"] = 3
    with pytest.raises(RemoteRefused, match="even a single group is too large"):
        RemoteReward(url, reward="x", kind="groupwise", retries=0, on_failure="nan")(numbered(range(4), [5] * 4))


@pytest.mark.parametrize("status", [429, 503])
def test_retry_after_replaces_the_backoff(scripted_server, status):
    """A 429/503 with Retry-After: 0.3 is retried 0.3 s later, not after the client's own backoff (0 s here, 5 s
    below); a Retry-After beyond the attempt's timeout waits the timeout only."""
    url, state = scripted_server
    state["script"] = [(status, {"Retry-After": "0.3"})]
    assert RemoteReward(url, reward="x", retries=1, backoff=0.0)(numbered([1], [0])).tolist() == [1.0]
    (first, *_), (second, *_) = state["posts"]
    assert 0.3 <= second - first < 2.0
    state["script"], state["posts"] = [(status, {"Retry-After": "0.2"})], []
    start = time.perf_counter()
    assert RemoteReward(url, reward="x", retries=1, backoff=5.0)(numbered([1], [0])).tolist() == [1.0]
    assert time.perf_counter() - start < 3.0
    state["script"], state["posts"] = [(status, {"Retry-After": "3600"})], []
    assert RemoteReward(url, reward="x", retries=1, timeout=0.4)(numbered([1], [0])).tolist() == [1.0]
    (first, *_), (second, *_) = state["posts"]
    assert 0.4 <= second - first < 3.0


def test_retry_after_values():
    """Seconds (also fractional) or an HTTP date; anything else is ignored (the client's backoff applies)."""
    now = 1_800_000_000.0
    assert retry_after_seconds("7", now) == 7.0
    assert retry_after_seconds(" 0.25 ", now) == 0.25
    assert retry_after_seconds(formatdate(now + 12, usegmt=True), now) == 12.0
    assert retry_after_seconds(formatdate(now - 12, usegmt=True), now) == 0.0  # a date in the past: at once
    assert retry_after_seconds("-3", now) is None
    assert retry_after_seconds("soon", now) is None
    assert retry_after_seconds(None, now) is None

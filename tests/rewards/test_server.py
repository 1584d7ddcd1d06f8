"""The reward server and the remote reward, on loopback: wire format, batching, concurrency, restarts, failures,
tokens, the CLI, and the rewards benchmark on tiny models. Every server is stopped and every retry loop bounded."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from ports import free_port

from mmgrpo.bench import run_bench
from mmgrpo.cli import main as cli_main
from mmgrpo.config import ConfigError, RewardSpec
from mmgrpo.registry import REWARDS
from mmgrpo.rewards import RewardBatch, RewardZoo
from mmgrpo.rewards import bench as reward_bench
from mmgrpo.rewards import server as server_mod
from mmgrpo.rewards.remote import (
    RemoteError,
    RemoteRefused,
    RemoteReward,
    WireVersionError,
    group_chunks,
    request_json,
)
from mmgrpo.rewards.server import (
    BINARY_TYPE,
    JSON_TYPE,
    BindError,
    RewardServer,
    decode_request,
    encode_request,
    is_loopback,
    load_server_config,
    serve,
)

ROOT = Path(__file__).resolve().parents[2]

SERVER_MODULE = '''
import time

import torch

LOG = []  # (client, step, batch size) in the order the server scored the batches
SLOW_S = 0.0


def numbered(batch):
    """Prompts are "<client> <step> <value>": scores the value, logs the batch."""
    client, step, _ = batch.prompts[0].split()
    LOG.append((client, int(step), len(batch)))
    return [float(p.split()[-1]) for p in batch.prompts]


def with_subs(batch):
    return {"score": [10.0 * i for i in range(len(batch))], "extra": [1.0] * len(batch)}


def meta_sum(batch):
    return [float(m["weights"].double().sum()) + len(m["tags"]) for m in batch.meta]


def broken(batch):
    raise ValueError("judge exploded")


def slow(batch):
    """Scores the prompt lengths after SLOW_S seconds; logs each batch it scores."""
    LOG.append(("slow", 0, len(batch)))
    time.sleep(SLOW_S)
    return [float(len(p)) for p in batch.prompts]
'''


@pytest.fixture
def mod(tmp_path, monkeypatch):
    """The module above on sys.path as ``server_test_rewards``, its log cleared."""
    (tmp_path / "server_test_rewards.py").write_text(textwrap.dedent(SERVER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    import server_test_rewards

    server_test_rewards.LOG.clear()
    return server_test_rewards


def user(name, **args):
    return RewardSpec(name=f"server_test_rewards:{name}", args=args)


def image_batch(n=6, group_size=2, seed=0):
    # multiples of 1/256 are exact in float16: scores through the wire equal in-process ones
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 257, (n, 3, 16, 16), generator=g).float() / 256
    return RewardBatch(prompts=[f"p {i} {i}" for i in range(n)], group=torch.arange(n) // group_size, images=images)


# ---------------------------------------------------------------------------------------------------- wire format
@pytest.mark.parametrize("binary", [True, False])
def test_wire_round_trip(binary):
    batch = image_batch(4)
    batch.videos = torch.rand(4, 3, 3, 8, 8)
    batch.completions = ["a", "é", "", "d"]
    batch.meta = [{"weights": torch.arange(3), "f": torch.ones(2, dtype=torch.float32), "x": [1, {"y": None}]}] * 4
    content_type, body = encode_request(batch, ["sharpness"], "float16", binary=binary, request_id="r-1")
    assert content_type == (BINARY_TYPE if binary else JSON_TYPE)
    got, names, request_id = decode_request(content_type, body)
    assert names == ["sharpness"] and request_id == "r-1" and got.prompts == batch.prompts and got.completions == batch.completions
    assert torch.equal(got.group, batch.group) and torch.equal(got.images, batch.images)
    assert (got.videos - batch.videos).abs().max() < 5e-4 and got.videos.dtype == torch.float32
    assert got.meta[0]["weights"].dtype == torch.int64 and torch.equal(got.meta[0]["weights"], torch.arange(3))
    assert got.meta[0]["f"].dtype == torch.float32 and got.meta[0]["x"] == [1, {"y": None}]


def test_wire_uint8_pixels_and_malformed_requests():
    batch = image_batch(2)
    content_type, body = encode_request(batch, None, "uint8")
    got, names, request_id = decode_request(content_type, body)
    assert names is None and request_id is None and (got.images - batch.images).abs().max() <= 0.5 / 255 + 1e-6
    head, _, blob = body.partition(b"\n")
    with pytest.raises(ValueError, match="bad array in images: .*outside"):
        decode_request(content_type, head + b"\n" + blob[:10])
    with pytest.raises(ValueError, match="Content-Type must be"):
        decode_request("text/plain", body)
    with pytest.raises(ValueError, match="unknown request fields"):
        decode_request(JSON_TYPE, json.dumps({"prompts": [], "group": [], "oops": 1}).encode())
    for bad in (5, "", "x" * 129):
        with pytest.raises(ValueError, match="'request_id' must be a string of 1 to 128 characters"):
            decode_request(JSON_TYPE, json.dumps({"prompts": [], "group": [], "request_id": bad}).encode())
    with pytest.raises(ValueError, match="only JSON values and tensors"):
        encode_request(RewardBatch(prompts=["a"], group=torch.zeros(1, dtype=torch.long), meta=[{"o": object()}]))


@pytest.mark.parametrize("binary", [True, False])
def test_numpy_scalars_in_meta_travel_as_json_values(binary):
    """What works in-process works remotely: numpy scalars arrive as the equal Python values; what JSON cannot
    carry (a complex number, bytes) is still refused, naming the entry and its numpy type."""
    meta = [{"n": np.int64(3), "f": np.float32(0.5), "ok": np.bool_(True), "s": np.str_("x"),
             "nested": [np.uint8(7), {"d": np.float64(1.25)}], "a": np.array([1, 2])}]
    batch = RewardBatch(prompts=["a"], group=torch.zeros(1, dtype=torch.long), meta=meta)
    got = decode_request(*encode_request(batch, binary=binary))[0].meta[0]
    assert {k: got[k] for k in ("n", "f", "ok", "s", "nested")} == {"n": 3, "f": 0.5, "ok": True, "s": "x",
                                                                     "nested": [7, {"d": 1.25}]}
    assert type(got["n"]) is int and type(got["f"]) is float and type(got["ok"]) is bool
    assert torch.equal(got["a"], torch.tensor([1, 2]))
    for bad, name in ((np.complex128(1j), "complex128"), (np.bytes_(b"x"), "bytes_")):
        batch.meta = [{"x": bad}]
        with pytest.raises(ValueError, match=f"meta\\[0\\]\\['x'\\] is a {name}; only JSON values and tensors"):
            encode_request(batch, binary=binary)


def test_a_deeply_nested_request_is_a_400_not_a_dropped_connection():
    deep = ("[" * 100_000 + "]" * 100_000).encode()
    body = b'{"prompts": ' + deep + b', "group": []}'
    with pytest.raises(ValueError, match="nested too deeply"):
        decode_request(JSON_TYPE, body)
    with RewardServer([RewardSpec(name="sharpness")], port=0).start() as server:
        with pytest.raises(RemoteError, match="HTTP 400: bad request: .*nested too deeply"):
            request_json(server.url + "/v1/score", body=body, retries=0)
        assert request_json(server.url + "/health")["status"] == "ok"


@pytest.mark.parametrize("shape", [[-1], [2.5], [True, 3]])
def test_an_array_shape_that_is_not_whole_sizes_is_refused(shape):
    # numpy reads a negative count as "to the end": a meta array of shape [-1] took the images' bytes as its own,
    # and a size of 2.5 read 2 elements, both without an error
    batch = RewardBatch(prompts=["a", "b"], group=torch.zeros(2, dtype=torch.long), images=torch.rand(2, 3, 4, 4),
                        meta=[{"frames": torch.arange(6)}, {}])
    for binary in (True, False):
        content_type, body = encode_request(batch, None, binary=binary)
        head, newline, blob = body.partition(b"\n")
        obj = json.loads(head)
        obj["meta"][0]["frames"]["$array"]["shape"] = shape
        with pytest.raises(ValueError, match=r"bad array in meta\[0\]\['frames'\]: .*shape"):
            decode_request(content_type, json.dumps(obj).encode() + newline + blob)


def test_group_chunks_keep_groups_whole():
    group = torch.tensor([0, 0, 1, 1, 2, 2, 2, 2, 3, 0])
    assert group_chunks(group, 4) == [[0, 1, 9], [2, 3], [4, 5, 6, 7], [8]]
    assert group_chunks(group, 2) == [[0, 1, 9], [2, 3], [4, 5, 6, 7], [8]]  # a big group goes alone
    assert group_chunks(group, 100) == [[0, 1, 9, 2, 3, 4, 5, 6, 7, 8]]


# ---------------------------------------------------------------------------------------------------- serving
def test_remote_scores_equal_in_process_scores(mod):
    specs = [RewardSpec(name="sharpness"), user("numbered"), user("with_subs", clip=[0, 15]), user("meta_sum")]
    batch = image_batch(6)
    with RewardServer(specs, port=0).start() as server:
        remote = RemoteReward(server.url, reward="sharpness", max_batch=3)
        local = RewardZoo([RewardSpec(name="sharpness")])(batch)[0][:, 0]
        assert torch.equal(remote(batch), local)
        assert remote.failed_requests == 0
        RemoteReward(server.url, reward="server_test_rewards:numbered", max_batch=3)(batch)
        assert [size for _, _, size in mod.LOG] == [2, 2, 2]  # groups of 2, at most 3 per request
        subs = RemoteReward(server.url, reward="server_test_rewards:with_subs", max_batch=4)(batch)
        assert subs["score"].tolist() == [0.0, 10.0, 15.0, 15.0, 0.0, 10.0]  # clipped on the server, per request
        assert subs["extra"].tolist() == [1.0] * 6
        batch.meta = [{"weights": torch.full((2,), 0.5), "tags": ["a"] * i} for i in range(6)]
        assert RemoteReward(server.url, reward="server_test_rewards:meta_sum")(batch).tolist() == [1, 2, 3, 4, 5, 6]
        health = request_json(server.url + "/health")
        assert health["status"] == "ok" and health["wire_version"] == 2
        assert {r["name"]: (r["kind"], r["modality"]) for r in health["rewards"]}["sharpness"] == ("pointwise", "image")


def test_groupwise_reward_through_the_server():
    spec = RewardSpec(name="win_rate", args={"base": "sharpness"})
    batch = image_batch(8, group_size=4)
    with RewardServer([spec], port=0).start() as server:
        remote = RemoteReward(server.url, kind="groupwise", max_batch=5)  # the only reward; whole groups of 4
        out = remote(batch)
        local = RewardZoo([spec])(batch)[1]
        assert torch.equal(out["score"], local["win_rate/score"])
        assert torch.equal(out["failures"], local["win_rate/failures"])
        with pytest.raises(ValueError, match="is groupwise but this reward says kind=pointwise"):
            RemoteReward(server.url)(batch)


def test_concurrent_clients_get_their_own_results_in_order(mod):
    clients, steps = 4, 5

    def client(k):
        reward, results = RemoteReward(server.url, retries=0), []
        for step in range(steps):
            values = [k * 100 + step * 10 + i for i in range(4)]
            batch = RewardBatch(prompts=[f"c{k} {step} {v}" for v in values], group=torch.zeros(4, dtype=int))
            results.append((reward(batch).tolist(), [float(v) for v in values]))
        return results

    with RewardServer([user("numbered")], port=0).start() as server, ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(client, k) for k in range(clients)]
        results = [f.result(timeout=60) for f in futures]
    assert all(got == want for per_client in results for got, want in per_client)
    for k in range(clients):
        assert [step for c, step, _ in mod.LOG if c == f"c{k}"] == list(range(steps))


def test_client_survives_a_server_restart():
    batch = image_batch(4)
    specs = [RewardSpec(name="sharpness")]
    first = RewardServer(specs, port=0).start()
    port = int(first.url.rsplit(":", 1)[1])
    remote = RemoteReward(first.url, retries=12, backoff=0.05)
    expected = remote(batch)
    first.stop()
    out = {}
    caller = threading.Thread(target=lambda: out.setdefault("scores", remote(batch)))
    caller.start()
    time.sleep(0.4)  # the client is retrying against a closed port meanwhile
    with RewardServer(specs, port=port).start():
        caller.join(timeout=30)
    assert not caller.is_alive()
    assert torch.equal(out["scores"], expected)


def test_unreachable_server_fails_in_one_line_or_scores_nan():
    url = f"http://127.0.0.1:{free_port()}"
    batch = image_batch(6)
    with pytest.raises(RemoteError) as info:
        RemoteReward(url, retries=2, backoff=0.01)(batch)
    message = str(info.value)
    assert "\n" not in message and f"GET {url}/health failed after 3 attempts" in message  # the version check
    remote = RemoteReward(url, retries=1, backoff=0.01, on_failure="nan", max_batch=2)
    with pytest.warns(RuntimeWarning, match=f"3 request\\(s\\) failed, their samples score NaN: GET {url}/health"):
        scores = remote(batch)
    assert scores.isnan().all() and remote.failed_requests == 3


def test_failed_requests_keep_the_sub_scores_of_the_server_reward(mod):
    """Under on_failure=nan a failed call returns the same sub-scores as a good one (NaN): a reward whose logged
    names changed with the server's health would give processes different metric keys, and their gathers would
    not match."""
    batch = image_batch(4)
    server = RewardServer([user("with_subs")], port=0).start()
    remote = RemoteReward(server.url, retries=0, on_failure="nan")
    good = remote(batch)
    server.stop()
    with pytest.warns(RuntimeWarning, match="1 request\\(s\\) failed"):
        failed = remote(batch)
    assert set(good) == {"score", "extra"} and isinstance(failed, dict) and set(failed) == set(good)
    assert all(v.isnan().all() and v.shape == (4,) for v in failed.values())


def test_a_retry_after_a_read_timeout_is_not_scored_twice(mod):
    """The client times out while the server is still scoring and resends the batch: the server recognises the
    request id, waits for the first scoring and answers with it. The reward runs once."""
    mod.SLOW_S = 1.0
    batch = RewardBatch(prompts=["a", "bb", "ccc"], group=torch.zeros(3, dtype=torch.long))
    with RewardServer([user("slow")], port=0).start() as server:
        remote = RemoteReward(server.url, timeout=0.3, retries=6, backoff=0.1)
        start = time.perf_counter()
        assert remote(batch).tolist() == [1.0, 2.0, 3.0]
        assert time.perf_counter() - start >= 1.0  # longer than one 0.3 s attempt: the client did retry
        assert mod.LOG == [("slow", 0, 3)]


def test_the_server_answers_a_repeated_request_id_from_memory(mod, monkeypatch):
    monkeypatch.setattr(server_mod, "RECENT_REQUESTS", 2)
    batch = RewardBatch(prompts=["a", "bb"], group=torch.zeros(2, dtype=torch.long))

    def post(request_id):
        content_type, body = encode_request(batch, binary=False, request_id=request_id)
        return request_json(server.url + "/v1/score", body=body, content_type=content_type)

    with RewardServer([user("slow")], port=0).start() as server:
        first = post("id-1")
        assert post("id-1") == first and len(mod.LOG) == 1  # the same request again: not scored
        post(None)  # no id: scored each time
        post(None)
        assert len(mod.LOG) == 3
        post("id-2")  # the server remembers the last 2 ids: id-1 is forgotten
        post("id-3")
        post("id-3")
        assert len(mod.LOG) == 5
        post("id-1")
        assert len(mod.LOG) == 6


def test_the_client_checks_the_wire_version_once(mod, monkeypatch):
    batch = RewardBatch(prompts=["a"], group=torch.zeros(1, dtype=torch.long))
    with RewardServer([user("slow")], port=0).start() as server:
        monkeypatch.setattr(server_mod, "WIRE_VERSION", 1)  # an older server
        for policy in ("error", "nan"):  # a version mismatch is never a NaN score
            with pytest.raises(WireVersionError, match=f"^remote: the server at {server.url} speaks reward wire "
                                                       "version 1 and this client 2: run the same mmgrpo version"):
                RemoteReward(server.url, on_failure=policy)(batch)
        assert mod.LOG == []  # refused before sending a batch
        monkeypatch.setattr(server_mod, "WIRE_VERSION", 2)
        remote = RemoteReward(server.url)
        assert remote(batch).tolist() == [1.0] and remote.version_checked
        monkeypatch.setattr(server_mod, "WIRE_VERSION", 1)
        assert remote(batch).tolist() == [1.0]  # checked once, at the start: not again


def test_a_failing_server_reward_is_reported_and_the_server_keeps_serving(mod):
    with RewardServer([user("broken"), RewardSpec(name="sharpness")], port=0).start() as server:
        start = time.perf_counter()
        with pytest.raises(RemoteError, match=f"{server.url}/v1/score failed: HTTP 500: reward "
                                              "'server_test_rewards:broken' failed: ValueError: judge exploded"):
            RemoteReward(server.url, reward="server_test_rewards:broken", backoff=5.0)(image_batch(2))
        assert time.perf_counter() - start < 4.0  # a 500 is not retried
        assert RemoteReward(server.url, reward="sharpness")(image_batch(2)).shape == (2,)
        with pytest.raises(RemoteError, match="HTTP 400: this server has no reward \\['nope'\\]"):
            RemoteReward(server.url, reward="nope")(image_batch(2))
        with pytest.raises(RemoteError, match="HTTP 400: bad request: the request needs 'prompts'"):
            request_json(server.url + "/v1/score", {"group": []})
        with pytest.raises(RemoteError, match="HTTP 404: no such endpoint"):
            request_json(server.url + "/v2/other")


@pytest.mark.parametrize("main, subs", [(["oops", 1.0], {}), ([1.0, 2.0], {"x/extra": [1.0, "two"]}),
                                        ([[1.0], [2.0]], {}), (7, {})])
def test_a_malformed_score_reply_is_a_remote_error_that_on_failure_nan_absorbs(canned_server, main, subs):
    url, reply = canned_server
    reply["score"] = {"names": ["x"], "kinds": {"x": "pointwise"}, "main": {"x": main}, "scores": subs}
    batch = RewardBatch(prompts=["a", "b"], group=torch.zeros(2, dtype=torch.long))
    with pytest.raises(RemoteError, match=f"^POST {url}/v1/score answered a malformed reply \\(") as info:
        RemoteReward(url, retries=0)(batch)
    assert "\n" not in str(info.value)
    remote = RemoteReward(url, retries=0, on_failure="nan")
    with pytest.warns(RuntimeWarning, match="1 request\\(s\\) failed, their samples score NaN"):
        assert remote(batch).isnan().all()
    assert remote.failed_requests == 1


def test_a_taken_port_is_a_one_line_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(BindError, match=f"reward server: cannot listen on 127.0.0.1:{port}: "):
            RewardServer([RewardSpec(name="sharpness")], port=port)


def test_request_size_limit():
    """8 images of 16 px in float16 (12 KB) are over the 10 KB limit: the client sends them again as two requests of
    4 and gets the in-process scores. One 64 px image (24 KB) alone is too large: refused, whatever on_failure says."""
    batch = image_batch(8)
    with RewardServer([RewardSpec(name="sharpness")], port=0, max_request_mb=0.01).start() as server:
        with pytest.raises(RemoteError, match="HTTP 413: request of .* bytes is over the limit of 10485 bytes"):
            request_json(server.url + "/v1/score", body=encode_request(batch)[1], content_type=BINARY_TYPE)
        assert torch.equal(RemoteReward(server.url)(batch), RewardZoo([RewardSpec(name="sharpness")])(batch)[0][:, 0])
        big = RewardBatch(prompts=["p"], group=torch.zeros(1, dtype=torch.long), images=torch.rand(1, 3, 64, 64))
        with pytest.raises(RemoteRefused, match="HTTP 413: .* \\(even a single sample is too large for the server"):
            RemoteReward(server.url, on_failure="nan")(big)


# ---------------------------------------------------------------------------------------------------- security
def test_loopback_addresses():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "192.168.1.10", "example.com"))


def test_serves_on_ipv6_loopback():
    """``::1`` counts as loopback, so the server must really listen there (an IPv6 socket) and name itself with a
    bracketed URL that the remote reward can reach."""
    batch = image_batch(2)
    with RewardServer([RewardSpec(name="sharpness")], host="::1", port=0).start() as server:
        assert server.url.startswith("http://[::1]:")
        assert request_json(server.url + "/health")["status"] == "ok"
        assert torch.equal(RemoteReward(server.url)(batch), RewardZoo([RewardSpec(name="sharpness")])(batch)[0][:, 0])


def test_refuses_other_addresses_without_a_token_before_binding(monkeypatch, tmp_path):
    def no_bind(*args, **kwargs):
        raise AssertionError("the server bound a socket")

    monkeypatch.setattr(server_mod, "_HTTPServer", no_bind)
    with pytest.raises(ConfigError, match="refusing to serve rewards on '0.0.0.0' without a token"):
        RewardServer([RewardSpec(name="sharpness")], host="0.0.0.0")
    config = tmp_path / "serve.yaml"
    config.write_text("rewards:\n  - name: sharpness\n")
    monkeypatch.delenv("MMGRPO_TEST_UNSET_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="set the environment variable MMGRPO_TEST_UNSET_TOKEN"):
        serve(config, host="0.0.0.0", token_env="MMGRPO_TEST_UNSET_TOKEN")


def test_cli_refusal_exits_2(tmp_path, capsys, monkeypatch):
    config = tmp_path / "serve.yaml"
    config.write_text("rewards:\n  - name: sharpness\n")
    monkeypatch.delenv("MMGRPO_TEST_UNSET_TOKEN", raising=False)
    code = cli_main(["serve-rewards", str(config), "--host", "0.0.0.0", "--token-env", "MMGRPO_TEST_UNSET_TOKEN"])
    assert code == 2 and "config error: refusing to serve rewards on '0.0.0.0'" in capsys.readouterr().err


def test_a_served_token_read_with_its_newline_matches_the_clients(monkeypatch, tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("rewards:\n  - name: sharpness\n")
    monkeypatch.setenv("MMGRPO_TEST_TOKEN", "s3cret\n")  # as `export TOKEN=$(cat token.txt)` leaves it in a script
    with serve(config, port=0, token_env="MMGRPO_TEST_TOKEN").start() as server:
        assert RemoteReward(server.url, token_env="MMGRPO_TEST_TOKEN")(image_batch(2)).shape == (2,)
    monkeypatch.setenv("MMGRPO_TEST_TOKEN", "s3c\nret")
    with pytest.raises(ConfigError, match="^reward server: the token in MMGRPO_TEST_TOKEN holds a line break"):
        serve(config, port=0, token_env="MMGRPO_TEST_TOKEN")


def test_token_is_required_when_set(monkeypatch):
    batch = image_batch(2)
    with RewardServer([RewardSpec(name="sharpness")], port=0, token="s3cret").start() as server:
        monkeypatch.setenv("MMGRPO_TEST_TOKEN", "wrong")
        start = time.perf_counter()
        with pytest.raises(RemoteError, match="HTTP 401: missing or wrong token"):
            RemoteReward(server.url, token_env="MMGRPO_TEST_TOKEN", backoff=5.0)(batch)
        assert time.perf_counter() - start < 4.0  # a 401 is not retried
        big = RewardBatch(prompts=["p"] * 32, group=torch.arange(32), images=torch.rand(32, 3, 128, 128))
        with pytest.raises(RemoteError, match="HTTP 401"):  # a 3 MB body still gets the answer, not a reset
            RemoteReward(server.url, token_env="MMGRPO_TEST_TOKEN", retries=0)(big)
        monkeypatch.delenv("MMGRPO_TEST_TOKEN")
        with pytest.raises(RemoteError, match="HTTP 401"):
            RemoteReward(server.url, token_env="MMGRPO_TEST_TOKEN")(batch)
        with pytest.raises(RemoteError, match="HTTP 401"):
            request_json(server.url + "/health")
        monkeypatch.setenv("MMGRPO_TEST_TOKEN", "s3cret")
        assert RemoteReward(server.url, token_env="MMGRPO_TEST_TOKEN")(batch).shape == (2,)
        assert request_json(server.url + "/health", headers={"Authorization": "Bearer s3cret"})["status"] == "ok"


def test_the_bearer_scheme_is_case_insensitive_and_the_token_exact():
    """RFC 7235: the auth scheme's name is case-insensitive; the token itself is compared exactly."""
    with RewardServer([RewardSpec(name="sharpness")], port=0, token="s3cret").start() as server:
        for scheme in ("bearer", "BEARER", "bEaReR"):
            assert request_json(server.url + "/health", headers={"Authorization": f"{scheme} s3cret"})["status"] == "ok"
        for header in ("bearer S3CRET", "Bearer s3cret ", "Basic s3cret", "Bearers3cret", "s3cret"):
            with pytest.raises(RemoteError, match="HTTP 401"):
                request_json(server.url + "/health", headers={"Authorization": header}, retries=0)


# ---------------------------------------------------------------------------------------------------- config, CLI
def test_server_config_loading(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("server: {port: 9999}\nrewards:\n  - {name: sharpness, args: {saturate_at: 2.0}}\n")
    cfg = load_server_config(good)
    assert cfg.server.port == 9999 and cfg.server.host == "127.0.0.1"
    assert cfg.rewards[0].name == "sharpness" and cfg.rewards[0].args == {"saturate_at": 2.0}
    bad = tmp_path / "bad.yaml"
    bad.write_text("server: {prot: 1}\nrewards: [{name: sharpness}]\n")
    with pytest.raises(ConfigError, match="unknown key 'server.prot'"):
        load_server_config(bad)
    typed = tmp_path / "typed.yaml"
    typed.write_text("rewards: [{name: sharpness}, {name: sharpness, weight: abc}]\n")
    with pytest.raises(ConfigError, match="bad value for 'rewards.1.weight'"):
        load_server_config(typed)
    far = tmp_path / "far.yaml"  # stopped `serve-rewards` with an OverflowError traceback from the socket
    far.write_text("server: {port: 70000}\nrewards: [{name: sharpness}]\n")
    with pytest.raises(ConfigError, match=r"bad value for 'server.port': must be .*65535.*, got 70000"):
        load_server_config(far)
    empty = tmp_path / "empty.yaml"
    empty.write_text("server: {port: 1}\n")
    with pytest.raises(ConfigError, match="missing required key 'rewards'"):
        load_server_config(empty)
    with pytest.raises(ConfigError, match="configured twice"):
        RewardServer([RewardSpec(name="sharpness"), RewardSpec(name="sharpness")], port=0)
    with pytest.raises(ConfigError, match=r"'standardize' of \['sharpness'\] needs the whole training batch"):
        RewardServer([RewardSpec(name="sharpness", args={"standardize": True})], port=0)


def test_shipped_server_configs_load():
    configs = sorted((ROOT / "configs" / "rewards").glob("*.yaml"))
    assert configs
    for path in configs:
        cfg = load_server_config(path)
        assert cfg.rewards and cfg.server.host == "127.0.0.1", path


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_cli_serves_until_stopped(tmp_path, stop):
    """Ctrl-C (SIGINT) or a service manager's SIGTERM stops the server cleanly (exit 0). The child gets the default
    SIGINT handling: a shell's background job (``cmd &``, CI runners) starts with SIGINT ignored, and so would it."""
    config = tmp_path / "serve.yaml"
    config.write_text("rewards:\n  - name: sharpness\n")
    env = {k: v for k, v in os.environ.items() if k != "MMGRPO_REWARD_TOKEN"}
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)  # exec resets a handler, not SIG_IGN
    try:
        proc = subprocess.Popen([sys.executable, "-m", "mmgrpo", "serve-rewards", str(config), "--port", "0"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    finally:
        signal.signal(signal.SIGINT, inherited)
    try:
        line = proc.stdout.readline()  # printed once the socket is bound
        assert line.startswith("serving rewards [sharpness] on http://127.0.0.1:"), line + proc.stderr.read()
        url = line.split(" on ")[1].split()[0]
        assert RemoteReward(url, retries=0)(image_batch(2)).shape == (2,)
        proc.send_signal(stop)
        _, err = proc.communicate(timeout=60)  # drains stderr too: a full pipe would block the server's exit
        assert "stopped" in err, err[-3000:]
        assert proc.returncode == 0, err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


# ---------------------------------------------------------------------------------------------------- benchmark
def tiny_bench_models(t, root):
    """The bench's model rewards on the tiny models (one timed call per batch size keeps the test short)."""
    hps = {"checkpoint": t.hps_checkpoint, "model_name": t.clip_config}
    return {
        "clip_score": ("tiny", {"model_name": t.clip_config, "pretrained": t.clip_checkpoint}),
        "hpsv2": ("tiny", hps),
        "hpsv2.1": ("tiny", hps),
        "aesthetic": ("tiny", {"clip_model": t.clip_config, "clip_pretrained": t.clip_checkpoint,
                               "checkpoint": t.aesthetic_checkpoint, "embed_dim": 32}),
        "pickscore": ("tiny", {"model": t.pick_model, "processor": t.pick_processor}),
        "vlm_judge": reward_bench._build_judge(root),
    }


def test_rewards_bench_times_every_registered_reward(tiny_models, monkeypatch, tmp_path):
    """Run as `mmgrpo bench rewards --threads 1` runs it: every registered reward is timed or skipped with a reason,
    the thread count asked for is used and recorded, and the caller's count comes back."""
    monkeypatch.setattr(reward_bench, "_build_models", lambda root: tiny_bench_models(tiny_models, root))
    monkeypatch.setattr(reward_bench, "REPEATS", {1: 1, 32: 1})
    monkeypatch.setattr(REWARDS, "_entries", dict(REWARDS._entries))
    REWARDS.register("bench_test_plugin", lambda batch: [0.0] * len(batch))  # a reward the bench has no case for
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        result = run_bench("rewards", str(tmp_path / "R.json"), threads=1)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert json.loads((tmp_path / "R.json").read_text()) == result
    json.dumps(result, allow_nan=False)
    rows, figures = result["rows"], result["figures"]
    skipped = {r["reward"]: r["skipped"] for r in rows if "skipped" in r}
    rows = [r for r in rows if "skipped" not in r]
    assert result["machine"]["torch_threads"] == 1 and {r["threads"] for r in rows} == {1}
    timed = [r["reward"] for r in rows]
    assert len(set(timed)) == len(timed) and sorted([*timed, *skipped]) == REWARDS.names()
    assert list(skipped) == ["bench_test_plugin"] and figures["skipped"] == 1 and skipped["bench_test_plugin"]
    assert {e.name for e in REWARDS if e.obj.__module__.startswith("mmgrpo.rewards")} <= set(timed)
    for row in rows:
        assert row["batch32_per_s"] > 0, row
        if row["reward"] == "vlm_pairwise":  # a group of one has no pair to judge
            assert row["batch1_per_s"] is None and f"batch32_vs_batch1/{row['reward']}" not in figures
        else:
            assert figures[f"batch32_vs_batch1/{row['reward']}"] == row["speedup"] > 0, row
    assert figures["remote_overhead"] > 0 and figures["remote_overhead_batch1"] > 0


def test_rewards_bench_failure_restores_the_thread_count(monkeypatch):
    def broken(root):
        raise RuntimeError("no models")

    monkeypatch.setattr(reward_bench, "_build_models", broken)
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="no models"):
        run_bench("rewards", None, threads=before + 1)
    assert torch.get_num_threads() == before

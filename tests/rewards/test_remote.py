"""The remote reward against a canned reward server on loopback: replies that do not fit the request."""

import pytest
import torch

from mmgrpo.rewards import RewardBatch
from mmgrpo.rewards.remote import RemoteError, RemoteReward


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

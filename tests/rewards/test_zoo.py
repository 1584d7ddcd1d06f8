"""RewardZoo: built once, rewards run concurrently, devices, clip/standardize, NaN accounting, one-line failures."""

import math
import textwrap
import threading
import warnings

import pytest
import torch

from mmgrpo.config import ConfigError, RewardSpec
from mmgrpo.rewards import RewardBatch, RewardZoo
from mmgrpo.rewards.zoo import RewardError, standardize_scores

ZOO_MODULE = '''
import threading

import torch

from mmgrpo.rewards import Reward

BUILT = []          # one entry per constructor call
BARRIER = None      # set by a test: rewards that wait on it prove they run at the same time
SEEN = []           # (reward, thread name, images device) per call


class Counting(Reward):
    """Counts its constructions; scores the prompt length."""

    def __init__(self, offset=0.0):
        BUILT.append(self)
        self.offset = offset

    def __call__(self, batch):
        return torch.tensor([len(p) + self.offset for p in batch.prompts], dtype=torch.float64)


class Meeting(Reward):
    """Waits at BARRIER before scoring, so two of them only finish when they run concurrently."""

    def __init__(self, value):
        self.value = value

    def __call__(self, batch):
        SEEN.append(("meeting", threading.current_thread().name, None))
        BARRIER.wait()
        return [self.value] * len(batch)


class Placed(Reward):
    """Takes a device in its constructor and records where it was moved and what it was given."""

    def __init__(self, device=None):
        self.built_on = device
        self.moved_to = None

    def to(self, device):
        self.moved_to = torch.device(device)
        return self

    def __call__(self, batch):
        SEEN.append(("placed", threading.current_thread().name, batch.images.device.type))
        return [1.0] * len(batch)


class Moved(Reward):
    """Has no device argument: only .to() places it."""

    def __init__(self):
        self.moved_to = None

    def to(self, device):
        self.moved_to = torch.device(device)
        return self

    def __call__(self, batch):
        SEEN.append(("moved", threading.current_thread().name, batch.images.device.type))
        return [2.0] * len(batch)


def fixed(batch):
    return {"score": [1.0, 5.0, 3.0, float("nan")], "extra": [0.0] * 4}


def all_nan(batch):
    return [float("nan")] * len(batch)


class SomePrompts(Reward):
    """Applies to prompts that name a relation only ("left of"); NaN for the others, by design."""

    conditional = True

    def __call__(self, batch):
        return [1.0 if "left of" in p else float("nan") for p in batch.prompts]


def broken(batch):
    raise ZeroDivisionError("boom\\nsecond line")


def grad_mode(batch):
    return [float(torch.is_grad_enabled())] * len(batch)


def group_rank(batch):
    """A groupwise plain function: each sample's rank by prompt length within its group; NaN alone."""
    out = []
    for i, g in enumerate(batch.group.tolist()):
        peers = [len(p) for p, h in zip(batch.prompts, batch.group.tolist()) if h == g]
        out.append(float("nan") if len(peers) == 1 else float(sorted(peers).index(len(batch.prompts[i]))))
    return out


group_rank.mmgrpo_info = {"kind": "groupwise", "modality": "text"}
'''


@pytest.fixture
def mod(tmp_path, monkeypatch):
    """The module above on sys.path as ``zoo_test_rewards``, state reset for each test."""
    (tmp_path / "zoo_test_rewards.py").write_text(textwrap.dedent(ZOO_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    import zoo_test_rewards

    zoo_test_rewards.BUILT.clear()
    zoo_test_rewards.SEEN.clear()
    return zoo_test_rewards


def batch4(**fields):
    return RewardBatch(prompts=["a", "bb", "ccc", "dddd"], group=torch.tensor([0, 0, 1, 1]), **fields)


def spec(name, weight=1.0, **args):
    return RewardSpec(name=f"zoo_test_rewards:{name}", weight=weight, args=args)


def test_rewards_are_built_once_and_kept(mod):
    zoo = RewardZoo([spec("Counting", offset=1.0), RewardSpec(name="length", args={"max_len": 3})])
    assert len(mod.BUILT) == 1
    for _ in range(3):
        main, _, seconds = zoo(batch4(completions=["x", "yy", "zzz", "wwww"]))
    assert len(mod.BUILT) == 1 and zoo.rewards[0] is mod.BUILT[0]
    assert main[:, 0].tolist() == [2.0, 3.0, 4.0, 5.0]
    assert main.dtype == torch.float64 and main.shape == (4, 2)
    assert set(seconds) == {"zoo_test_rewards:Counting", "length"} and all(s >= 0 for s in seconds.values())
    assert zoo.weights.tolist() == [1.0, 1.0] and zoo.names == ["zoo_test_rewards:Counting", "length"]


def test_independent_rewards_run_concurrently(mod):
    # each reward blocks at a 2-party barrier: the call can only finish if both run at the same time
    mod.BARRIER = threading.Barrier(2, timeout=20)
    zoo = RewardZoo([spec("Meeting", value=1.0), spec("Meeting", weight=2.0, value=2.0)])
    main, _, _ = zoo(batch4())
    assert main.tolist() == [[1.0, 2.0]] * 4
    assert len({thread for _, thread, _ in mod.SEEN}) == 2
    # one after another in the caller's thread: the barrier breaks instead
    mod.BARRIER = threading.Barrier(2, timeout=0.5)
    with pytest.raises(RewardError, match="reward 'zoo_test_rewards:Meeting' failed: BrokenBarrierError"):
        RewardZoo([spec("Meeting", value=1.0), spec("Meeting", value=2.0)], max_workers=1)(batch4())


@pytest.mark.parametrize("workers", [None, 1])
def test_rewards_run_without_grad(mod, workers):
    zoo = RewardZoo([spec("grad_mode"), spec("grad_mode")], max_workers=workers)
    with torch.enable_grad():
        main, _, _ = zoo(batch4())
    assert (main == 0).all()


def test_device_arg_places_the_reward_and_its_inputs(mod):
    # the meta device stands in for a GPU: moving tensors there works without one
    images = torch.rand(4, 3, 8, 8)
    zoo = RewardZoo([spec("Placed", device="meta"), spec("Moved", device="meta"), spec("Counting")])
    placed, moved, counting = zoo.rewards
    assert placed.built_on == torch.device("meta") and placed.moved_to == torch.device("meta")
    assert moved.moved_to == torch.device("meta")  # no device parameter: .to() only
    assert counting.offset == 0.0  # a reward without the arg is built as usual
    main, _, _ = zoo(batch4(images=images))
    assert main[:, :2].tolist() == [[1.0, 2.0]] * 4
    assert sorted(device for _, _, device in mod.SEEN) == ["meta", "meta"]
    assert images.device.type == "cpu"  # the caller's batch is untouched


def test_clip_and_standardize_change_the_main_score_not_the_logged_one(mod):
    zoo = RewardZoo([spec("fixed", clip=[2.0, 4.0]), spec("fixed", standardize=True),
                     spec("fixed", clip=[2, 4], standardize=True)])
    main, logged, _ = zoo(batch4())
    assert main[:3, 0].tolist() == [2.0, 4.0, 3.0] and math.isnan(main[3, 0])
    assert main[:3, 1].tolist() == [1.0, 5.0, 3.0]  # standardising waits for the whole batch
    assert main[:3, 2].tolist() == [2.0, 4.0, 3.0]
    whole = zoo.standardize(torch.cat([main, main + 1.0]))  # as if two processes had scored these
    assert whole[:3, 0].tolist() == [2.0, 4.0, 3.0]
    z = torch.tensor([1.0, 5.0, 3.0, 2.0, 6.0, 4.0], dtype=torch.float64)
    torch.testing.assert_close(whole[[0, 1, 2, 4, 5, 6], 1], (z - z.mean()) / z.std(unbiased=False), rtol=0, atol=1e-6)
    clipped = torch.tensor([2.0, 4.0, 3.0, 3.0, 5.0, 4.0], dtype=torch.float64)
    torch.testing.assert_close(whole[[0, 1, 2, 4, 5, 6], 2], (clipped - 3.5) / clipped.std(unbiased=False),
                               rtol=0, atol=1e-6)
    assert whole[[3, 7]].isnan().all()
    assert logged["zoo_test_rewards:fixed/score"][:3].tolist() == [1.0, 5.0, 3.0]  # raw


def test_standardize_scores_edge_cases():
    constant = standardize_scores(torch.full((3,), 7.0, dtype=torch.float64))
    assert constant.tolist() == [0.0, 0.0, 0.0]
    nan = standardize_scores(torch.full((2,), math.nan, dtype=torch.float64))
    assert nan.isnan().all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("value", [0.1, 0.7, 1e6 + 0.1])
def test_a_constant_batch_standardizes_to_exact_zeros(value, dtype):
    """The mean of equal values is not always that value in floating point (0.1 x 7 in float32 came out -0.43
    after dividing by the epsilon); equal scores must still become exactly 0, NaN staying NaN."""
    scores = torch.full((7,), value, dtype=dtype)
    scores[2] = math.nan
    out = standardize_scores(scores)
    assert out[2].isnan() and out[[0, 1, 3, 4, 5, 6]].tolist() == [0.0] * 6


def test_standardize_scores_z_scores_a_batch_far_from_zero():
    scores = torch.tensor([1e6 + 1, 1e6 + 2, math.nan, 1e6 + 3], dtype=torch.float64)
    out = standardize_scores(scores)
    expected = math.sqrt(1.5)  # (x - mean) / population std of [1, 2, 3]
    assert out[[0, 1, 3]].tolist() == pytest.approx([-expected, 0.0, expected], abs=1e-7) and out[2].isnan()


def test_bad_zoo_args_are_named(mod):
    with pytest.raises(ConfigError, match=r"bad value for 'rewards.0.args.clip': must be \[lo, hi\] with lo <= hi"):
        RewardZoo([spec("Counting", clip=[3, 1])])
    with pytest.raises(ConfigError, match="'rewards.1.args.standardize': must be true or false; got 'yes'"):
        RewardZoo([spec("Counting"), spec("Counting", standardize="yes")])
    with pytest.raises(ConfigError, match="unknown key 'rewards.0.args.ofset' for reward .*Counting' \\(closest: 'offset'\\)"):
        RewardZoo([spec("Counting", ofset=1.0)])
    with pytest.raises(ConfigError, match="bad value for 'rewards.0.name': unknown reward 'pikscore'; did you mean"):
        RewardZoo([RewardSpec(name="pikscore")])
    with pytest.raises(ValueError, match="max_workers"):
        RewardZoo([spec("Counting")], max_workers=0)


def test_a_reward_named_twice_is_logged_apart(mod):
    # scores, sub-scores, wall times, NaN counts and the trainer's metrics are keyed by name: the second entry of a
    # name (vlm_judge with two presets, video_frames over two image rewards) replaced the first one's logged scores
    zoo = RewardZoo([spec("Counting"), spec("fixed"), spec("Counting", offset=1.0), spec("fixed", clip=[2, 4])])
    first, second = "zoo_test_rewards:Counting", "zoo_test_rewards:fixed"
    assert zoo.names == [first, second, f"{first}#2", f"{second}#2"]
    main, logged, seconds = zoo(batch4())
    assert logged[first].tolist() == main[:, 0].tolist() and logged[f"{first}#2"].tolist() == (main[:, 0] + 1).tolist()
    assert logged[f"{second}#2/score"][:3].tolist() == [1.0, 5.0, 3.0] and main[:3, 3].tolist() == [2.0, 4.0, 3.0]
    assert set(seconds) == set(zoo.names) and zoo.nan_counts == {first: 0, second: 1, f"{first}#2": 0, f"{second}#2": 1}
    only, logged, _ = zoo(batch4(), only=[f"{first}#2"])
    assert only[:, 0].tolist() == (main[:, 0] + 1).tolist() and list(logged) == [f"{first}#2"]


def test_every_spec_is_checked_before_any_reward_is_built(mod):
    mod.BUILT.clear()
    with pytest.raises(ConfigError, match="unknown key 'rewards.1.args.qualty' .*closest: 'quality'"):
        RewardZoo([spec("Counting"), RewardSpec(name="jpeg_compressibility", args={"qualty": 90})])
    assert mod.BUILT == []


@pytest.mark.parametrize(("name", "args", "message"), [
    ("win_rate", {"base": "clip_scor"}, r"bad value for 'rewards.0.args.base': unknown reward 'clip_scor'; did you mean"),
    ("win_rate", {"base": "sharpness", "base_args": {"saturate": 1}},
     r"unknown key 'rewards.0.args.base_args.saturate' for 'sharpness' \(closest: 'saturate_at'\)"),
    ("win_rate", {"base": "sharpness", "base_args": [1]}, r"'rewards.0.args.base_args': must be a mapping"),
    ("video_frames", {"image_reward": "win_rate", "image_reward_args": {"base": "sharpness", "base_args": {"x": 1}}},
     r"unknown key 'rewards.0.args.image_reward_args.base_args.x' for 'sharpness'"),
    ("vlm_judge", {"backend": "openai", "backend_args": {"url": "http://x"}},
     r"unknown key 'rewards.0.args.backend_args.url' for 'openai' \(closest: 'base_url'\)"),
    ("vlm_judge", {"backend_args": {}}, r"missing required key 'rewards.0.args.backend_args.model' for the backend"),
    ("vlm_judge", {"backend": "vllm"}, r"bad value for 'rewards.0.args.backend': backend must be one of"),
    ("temporal_bonus", {"accuracy_args": {"bogus": 1}}, r"unknown key 'rewards.0.args.accuracy_args.bogus'"),
])
def test_nested_reward_args_are_checked_and_named(name, args, message):
    with pytest.raises(ConfigError, match=message):
        RewardZoo([RewardSpec(name=name, args=args)])


def test_a_value_the_constructor_refuses_is_a_config_error_naming_the_spec():
    with pytest.raises(ConfigError, match=r"bad value in 'rewards.0' \(win_rate\): win_rate: margin must be >= 0"):
        RewardZoo([RewardSpec(name="win_rate", args={"base": "sharpness", "margin": -1.0})])
    with pytest.raises(ConfigError, match=r"'rewards.0' \(remote\): remote: url must be http://host:port .*'not a "
                                          "url'"):  # refused before the first step, not at the first request
        RewardZoo([RewardSpec(name="remote", args={"url": "not a url"})])


def test_nan_counts_and_a_single_warning_for_an_all_nan_reward(mod):
    zoo = RewardZoo([spec("all_nan"), spec("fixed")])
    with pytest.warns(RuntimeWarning, match="reward 'zoo_test_rewards:all_nan' returned NaN .* all 4 samples"):
        zoo(batch4())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: a second all-NaN batch is quiet
        main, _, _ = zoo(batch4())
    assert main[:, 0].isnan().all()
    assert zoo.nan_counts == {"zoo_test_rewards:all_nan": 8, "zoo_test_rewards:fixed": 2}


def test_a_conditional_reward_that_applies_to_none_of_a_batch_is_counted_not_warned(mod):
    zoo = RewardZoo([spec("SomePrompts")])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        main, _, _ = zoo(batch4())
    assert main[:, 0].isnan().all() and zoo.nan_counts == {"zoo_test_rewards:SomePrompts": 4}


def test_a_failing_reward_is_named_in_one_line(mod):
    zoo = RewardZoo([spec("Counting"), spec("broken")])
    with pytest.raises(RewardError) as info:
        zoo(batch4())
    assert str(info.value) == "reward 'zoo_test_rewards:broken' failed: ZeroDivisionError: boom second line"
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_only_scores_a_subset(mod):
    zoo = RewardZoo([spec("Counting"), spec("fixed")])
    main, logged, seconds = zoo(batch4(), only=["zoo_test_rewards:fixed"])
    assert main.shape == (4, 1) and main[0, 0] == 1.0
    assert list(seconds) == ["zoo_test_rewards:fixed"] and "zoo_test_rewards:Counting" not in logged
    with pytest.raises(ValueError, match="no reward named"):
        zoo(batch4(), only=["nope"])


def test_evaluation_leaves_groupwise_rewards_out(mod):
    """Held-out evaluation has one sample per prompt: groupwise rewards would be NaN there (and warn), so
    ``evaluation_names`` leaves them out; training batches still score them."""
    specs = [spec("Counting"), RewardSpec(name="win_rate", args={"base": "zoo_test_rewards:Counting"}),
             spec("group_rank")]
    zoo = RewardZoo(specs)
    assert [r.kind for r in zoo.rewards] == ["pointwise", "groupwise", "groupwise"]
    assert zoo.evaluation_names == ["zoo_test_rewards:Counting"]
    held_out = RewardBatch(prompts=["a", "bb", "ccc"], group=torch.arange(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        main, logged, _ = zoo(held_out, only=zoo.evaluation_names)
    assert main[:, 0].tolist() == [1.0, 2.0, 3.0] and set(logged) == {"zoo_test_rewards:Counting"}
    with pytest.warns(RuntimeWarning) as warned:  # what evaluation used to do: all NaN, and a warning each
        main, _, _ = zoo(held_out)
    assert sorted(str(w.message).split("'")[1] for w in warned) == ["win_rate", "zoo_test_rewards:group_rank"]
    assert main[:, 1:].isnan().all()
    main, _, _ = zoo(batch4())  # groups of two: the groupwise rewards apply
    assert main[:, 1].tolist() == [0.0, 1.0, 0.0, 1.0] and main[:, 2].tolist() == [0.0, 1.0, 0.0, 1.0]

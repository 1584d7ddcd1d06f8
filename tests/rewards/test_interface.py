"""The reward interface: every way of writing a reward, as a user would, through build_reward and RewardZoo."""

import math
import re
import textwrap
from importlib import metadata

import pytest
import torch

from mmgrpo.cli import main as cli_main
from mmgrpo.config import ConfigError, RewardSpec
from mmgrpo.registry import REWARDS, RegistryError
from mmgrpo.rewards import FunctionReward, Reward, RewardBatch, RewardZoo, build_reward
from mmgrpo.rewards.base import is_trl_signature
from mmgrpo.rewards.zoo import RewardError

USER_MODULE = '''
import torch


def plain(batch):
    """A plain function reward: the prompt length."""
    return [float(len(p)) for p in batch.prompts]


def trl_style(prompts, completions, solution, **kwargs):
    """TRL signature: meta columns arrive as keyword lists; None means not applicable."""
    return [None if s is None else float(c == s) for c, s in zip(completions, solution)]


def open_r1_accuracy(completions, solution, **kwargs):
    """TRL / open-r1 style without a prompts parameter: TRL passes everything by keyword."""
    return [float(c == s) for c, s in zip(completions, solution)]


def completion_length(completions, **kwargs):
    return [float(len(c)) for c in completions]


def conversational_accuracy(prompts, completions, solution, **kwargs):
    """open-r1 / Video-R1 style: TRL's chat format, completion[0]["content"]."""
    assert prompts[0][0]["role"] == "user"
    return [float(c[0]["content"] == s) for c, s in zip(completions, solution)]


def sees_inputs(batch):
    """Reads the input images and the per-sample meta."""
    return batch.images.mean(dim=(1, 2, 3)) * torch.tensor([m["scale"] for m in batch.meta])


def sub_scores(batch):
    return {"a": [1.0, 2.0], "b": [3.0, float("nan")]}


def with_score(batch):
    return {"score": [5.0, 6.0], "extra": [0.0, 0.0]}


def with_nan(batch):
    return torch.tensor([float("nan"), 0.5])


def wrong_length(batch):
    return [1.0, 2.0, 3.0]


def infinite(batch):
    return [1.0, float("inf")]


def words(batch):
    return ["good", "bad"]


def no_scores(batch):
    return {}
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user's reward file on sys.path, referenced as ``user_rewards_mod:fn``."""
    (tmp_path / "user_rewards_mod.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_rewards_mod"


def batch2(**fields):
    return RewardBatch(prompts=["a", "bcd"], group=torch.zeros(2, dtype=torch.long), **fields)


def zoo(*names, **args):
    return RewardZoo([RewardSpec(name=n, args=args) for n in names])


def test_plain_function_by_import_path(user_module):
    reward = build_reward(f"{user_module}:plain")
    assert isinstance(reward, FunctionReward) and reward.kind == "pointwise"
    main, logged, seconds = zoo(f"{user_module}:plain")(batch2())
    assert main[:, 0].tolist() == [1.0, 3.0]
    assert list(logged) == [f"{user_module}:plain"] and seconds[f"{user_module}:plain"] >= 0


def test_a_function_called_on_batches_takes_no_args_and_says_so(user_module):
    """Args meant for a batch-called function would be passed to it as a factory call; the config error says why
    instead of suggesting its batch parameter."""
    with pytest.raises(ConfigError, match=rf"unknown key 'rewards.0.args.scale': reward '{user_module}:plain' is a "
                                          r"function called on each batch .* takes no args; .*register a factory"):
        zoo(f"{user_module}:plain", scale=2.0)
    with pytest.raises(ConfigError, match=rf"unknown key 'rewards.0.args.scale': reward '{user_module}:trl_style' "
                                          r"is a TRL-style function; its only arg is conversational"):
        zoo(f"{user_module}:trl_style", scale=2.0)
    with pytest.raises(ConfigError, match=r"bad value for 'rewards.0.args.conversational': must be true or false"):
        zoo(f"{user_module}:trl_style", conversational="yes")


def test_a_conversational_trl_reward_gets_the_chat_format(user_module):
    """TRL passes conversational datasets' prompts and completions as message lists, which open-r1's and Video-R1's
    rewards read (``completion[0]["content"]``); ``conversational: true`` passes them so."""
    batch = batch2(completions=["x", "yy"], meta=[{"solution": "x"}, {"solution": "z"}])
    main, _, _ = zoo(f"{user_module}:conversational_accuracy", conversational=True)(batch)
    assert main[:, 0].tolist() == [1.0, 0.0]
    with pytest.raises(RewardError, match="string indices must be integers"):  # plain strings by default
        zoo(f"{user_module}:conversational_accuracy")(batch)


def test_trl_style_function_is_wrapped(user_module):
    from user_rewards_mod import plain, trl_style

    assert is_trl_signature(trl_style) and not is_trl_signature(plain)
    reward = build_reward(f"{user_module}:trl_style")
    assert reward.modality == "text"
    batch = batch2(completions=["x", "y"], meta=[{"solution": "x"}, {"solution": None}])
    out = reward(batch)
    assert out[0].item() == 1.0 and math.isnan(out[1])


def test_trl_functions_without_a_prompts_parameter_get_their_columns_by_keyword(user_module):
    """TRL calls ``fn(prompts=..., completions=..., **columns)``, so its rewards often skip ``prompts``
    (``accuracy_reward(completions, solution, **kwargs)``): they work unchanged too."""
    from user_rewards_mod import completion_length, open_r1_accuracy

    assert is_trl_signature(open_r1_accuracy) and is_trl_signature(completion_length)
    batch = batch2(completions=["x", "yy"], meta=[{"solution": "x"}, {"solution": "z"}])
    main, _, _ = zoo(f"{user_module}:open_r1_accuracy", f"{user_module}:completion_length")(batch)
    assert main.tolist() == [[1.0, 1.0], [0.0, 2.0]]


def test_custom_reward_sees_images_and_meta(user_module):
    images = torch.stack([torch.full((3, 4, 4), 0.25), torch.full((3, 4, 4), 1.0)])
    batch = batch2(images=images, meta=[{"scale": 2.0}, {"scale": 3.0}])
    main, _, _ = zoo(f"{user_module}:sees_inputs")(batch)
    assert main[:, 0].tolist() == [0.5, 3.0]


def test_sub_scores_main_column_and_logged_names(user_module):
    name = f"{user_module}:sub_scores"
    main, logged, _ = zoo(name)(batch2())
    assert sorted(logged) == [f"{name}/a", f"{name}/b"]
    assert main[:, 0].tolist() == [2.0, 2.0]  # no 'score' key: nan-mean of the sub-scores
    main, logged, _ = zoo(f"{user_module}:with_score")(batch2())
    assert main[:, 0].tolist() == [5.0, 6.0]  # the 'score' sub-score is the main column
    assert f"{user_module}:with_score/extra" in logged


def test_nan_passes_through(user_module):
    main, logged, _ = zoo(f"{user_module}:with_nan")(batch2())
    assert math.isnan(main[0, 0]) and main[1, 0] == 0.5
    assert math.isnan(logged[f"{user_module}:with_nan"][0])


@pytest.mark.parametrize(("fn", "message"), [
    ("wrong_length", "returned 3 scores for a batch of 2"),
    ("infinite", r"returned an infinite score for 1 of 2 samples \(return NaN"),
    ("words", "returned list, not numbers"),
    ("no_scores", r"returned an empty dict, not scores"),
])
def test_malformed_output_is_a_one_line_reward_error(user_module, fn, message):
    with pytest.raises(RewardError, match=f"^reward '{user_module}:{fn}' {message}") as err:
        zoo(f"{user_module}:{fn}")(batch2())
    assert "\n" not in str(err.value)


def test_builtin_rewards_mix_in_one_zoo():
    specs = [RewardSpec(name="format"), RewardSpec(name="accuracy", weight=2.0),
             RewardSpec(name="length", args={"max_len": 100})]
    batch = batch2(completions=["<think>t</think><answer>B</answer>", "<answer>A</answer>"],
                   meta=[{"problem_type": "multiple choice", "solution": "B"}] * 2)
    main, logged, _ = RewardZoo(specs)(batch)
    assert main.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 1.0]]
    assert sorted(logged) == ["accuracy", "format", "length"]


def test_registry_lists_the_rule_rewards_with_kind_and_modality():
    expected = {
        "format": ("pointwise", "text"), "accuracy": ("pointwise", "text"), "length": ("pointwise", "text"),
        "temporal_iou": ("pointwise", "text"), "jpeg_compressibility": ("pointwise", "image"),
        "jpeg_incompressibility": ("pointwise", "image"), "sharpness": ("pointwise", "image"),
        "color_fraction": ("pointwise", "image"), "win_rate": ("groupwise", "any"),
    }
    listed = {e.name: e for e in REWARDS}
    for name, (kind, modality) in expected.items():
        info = listed[name].info
        assert (info["kind"], info["modality"]) == (kind, modality), name
        assert info["description"] and "\n" not in info["description"]
        reward_cls = listed[name].obj
        assert (reward_cls.kind, reward_cls.modality) == (kind, modality), name  # class agrees with the listing


def test_unknown_reward_name_suggests_a_close_one():
    with pytest.raises(KeyError, match="did you mean 'accuracy'"):
        build_reward("acuracy")


PLUGIN_MODULE = '''
from mmgrpo.rewards import Reward


def brightest(batch):
    """Groupwise plain function: 1 for the brightest image of its group, else 0."""
    means = batch.images.mean(dim=(1, 2, 3))
    return [float(all(means[i] >= means[j] for j in range(len(batch)) if batch.group[j] == batch.group[i]))
            for i in range(len(batch))]


brightest.mmgrpo_info = {"kind": "groupwise", "modality": "image", "description": "1 for the brightest in its group"}


class Darkness(Reward):
    """A Reward subclass: its kind and modality are class attributes."""

    modality = "image"

    def __call__(self, batch):
        return 1 - batch.images.mean(dim=(1, 2, 3))
'''


@pytest.fixture
def plugin_package(tmp_path, monkeypatch):
    """Two rewards installed as ``mmgrpo.rewards`` entry points (real ``EntryPoint`` objects on a module of this
    test), with the reward registry re-read so that it picks them up; restored afterwards."""
    (tmp_path / "plugin_rewards_mod.py").write_text(textwrap.dedent(PLUGIN_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    installed = [metadata.EntryPoint("plugin_brightest", "plugin_rewards_mod:brightest", "mmgrpo.rewards"),
                 metadata.EntryPoint("plugin_darkness", "plugin_rewards_mod:Darkness", "mmgrpo.rewards")]
    original = metadata.entry_points

    def entry_points(**selection):
        return installed if selection.get("group") == "mmgrpo.rewards" else original(**selection)

    monkeypatch.setattr(metadata, "entry_points", entry_points)
    monkeypatch.setattr(REWARDS, "_entries", dict(REWARDS._entries))
    monkeypatch.setattr(REWARDS, "_loaded", False)


def test_a_broken_entry_point_is_skipped_with_a_warning_and_named_when_asked_for(monkeypatch, capsys):
    """A plug-in whose module does not import must not stop `mmgrpo rewards` or a run that uses other rewards; asked
    for by name, it is a one-line error that says why."""
    REWARDS.names()  # the built-in rewards first: the copy below must hold them, and they register once
    broken = metadata.EntryPoint("plugin_broken", "no_such_plugin_module_xyz:reward", "mmgrpo.rewards")
    original = metadata.entry_points
    monkeypatch.setattr(metadata, "entry_points", lambda **selection: [broken] if selection.get(
        "group") == "mmgrpo.rewards" else original(**selection))
    monkeypatch.setattr(REWARDS, "_entries", dict(REWARDS._entries))
    monkeypatch.setattr(REWARDS, "_broken", {})
    monkeypatch.setattr(REWARDS, "_loaded", False)
    with pytest.warns(RuntimeWarning, match=r"reward entry point plugin_broken = no_such_plugin_module_xyz:reward "
                                            r"cannot be loaded: ModuleNotFoundError: .*; skipped"):
        assert cli_main(["rewards"]) == 0
    assert re.search(r"│ format .*│ built-in +│", capsys.readouterr().out)
    assert isinstance(build_reward("format"), Reward)
    with pytest.raises(RegistryError, match=r"reward 'plugin_broken': entry point .* ModuleNotFoundError"):
        build_reward("plugin_broken")


def test_entry_point_rewards_keep_kind_and_modality(plugin_package, capsys):
    assert cli_main(["rewards"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:6]]
            for line in out.splitlines() if re.match(r"│ plugin_", line)}
    assert rows == {"plugin_brightest": ["groupwise", "image", "1 for the brightest in its group",
                                         "entry point plugin_rewards_mod:brightest"],
                    "plugin_darkness": ["pointwise", "image", "", "entry point plugin_rewards_mod:Darkness"]}
    assert re.search(r"│ format .*│ built-in +│", out)
    assert REWARDS.entry("plugin_darkness").info["source"] == "entry point plugin_rewards_mod:Darkness"
    brightest = build_reward("plugin_brightest")
    assert isinstance(brightest, FunctionReward) and (brightest.kind, brightest.modality) == ("groupwise", "image")
    zoo = RewardZoo([RewardSpec(name="plugin_brightest"), RewardSpec(name="plugin_darkness")])
    assert zoo.evaluation_names == ["plugin_darkness"]
    images = torch.stack([torch.full((3, 4, 4), v) for v in (0.2, 0.6, 0.4, 0.1)])
    main, _, _ = zoo(RewardBatch(prompts=["p"] * 4, group=torch.tensor([0, 0, 1, 1]), images=images))
    assert main[:, 0].tolist() == [0.0, 1.0, 1.0, 0.0]
    torch.testing.assert_close(main[:, 1], torch.tensor([0.8, 0.4, 0.6, 0.9], dtype=torch.float64))

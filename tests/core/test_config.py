"""Typed configs: presets with base inheritance, dotted overrides, one-line errors that name the key."""

import copy
import re
import subprocess
import sys
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from mmgrpo.cli import main
from mmgrpo.config import (
    BaseConfig,
    ConfigError,
    Range,
    check_ranges,
    get_key,
    key_docs,
    key_ranges,
    load_config,
    load_yaml,
    read_preset,
    to_yaml,
    valid_keys,
)
from mmgrpo.registry import PIPELINES


def write(path, data):
    path.write_text(yaml.safe_dump(data))
    return path


def test_base_chain_merges_nested_keys_and_replaces_lists(tmp_path):
    write(tmp_path / "root.yaml", {"pipeline": "toy_bandit:PIPELINE", "seed": 1,
                                   "train": {"max_steps": 5, "group_size": 4}, "optim": {"betas": [0.8, 0.9]}})
    write(tmp_path / "mid.yaml", {"base": "root.yaml", "train": {"group_size": 6}})
    leaf = write(tmp_path / "leaf.yaml", {"base": ["mid.yaml"], "optim": {"betas": [0.5, 0.6]}})
    raw = read_preset(leaf)
    assert raw["train"] == {"max_steps": 5, "group_size": 6}
    assert raw["optim"]["betas"] == [0.5, 0.6]
    cfg = load_config(leaf, ["train.max_steps=7", "optim.lr=0.5"])
    assert (cfg.train.max_steps, cfg.train.group_size, cfg.seed, cfg.optim.lr) == (7, 6, 1, 0.5)
    assert type(cfg).__name__ == "ToyConfig" and cfg.toy.num_arms == 4  # the pipeline's own schema


def test_unknown_override_names_the_key_and_the_closest(tmp_path):
    preset = write(tmp_path / "p.yaml", {"pipeline": "toy_bandit:PIPELINE"})
    with pytest.raises(ConfigError) as err:
        load_config(preset, ["train.max_step=3"])
    assert "'train.max_step'" in str(err.value) and "'train.max_steps'" in str(err.value)
    with pytest.raises(ConfigError, match="'no.such.key'"):
        load_config(preset, ["no.such.key=1"])


def test_unknown_key_in_yaml_and_wrong_type(tmp_path):
    bad = write(tmp_path / "bad.yaml", {"pipeline": "toy_bandit:PIPELINE", "train": {"grup_size": 3}})
    with pytest.raises(ConfigError, match="unknown key 'train.grup_size'.*'train.group_size'"):
        load_config(bad)
    preset = write(tmp_path / "p.yaml", {"pipeline": "toy_bandit:PIPELINE"})
    with pytest.raises(ConfigError, match="'train.max_steps'"):
        load_config(preset, ["train.max_steps=many"])
    with pytest.raises(ConfigError, match="'grpo.loss_aggregation'.*closest: 'token-mean'"):
        load_config(preset, ["grpo.loss_aggregation=token_mean"])
    with pytest.raises(ConfigError, match="'train.group_size'"):
        load_config(preset, ["train.group_size=0"])


def test_registry_and_scheduler_names_are_checked_at_load(tmp_path):
    preset = write(tmp_path / "p.yaml", {"pipeline": "toy_bandit:PIPELINE"})
    with pytest.raises(ConfigError, match="'optim.lr_scheduler'.*closest: 'cosine'"):
        load_config(preset, ["optim.lr_scheduler=cosin"])
    with pytest.raises(ConfigError, match="'optim.lr_scheduler'"):  # needs a metric to step on
        load_config(preset, ["optim.lr_scheduler=reduce_lr_on_plateau"])
    with pytest.raises(ConfigError, match="'grpo.advantage'.*'nope'"):
        load_config(preset, ["grpo.advantage=nope"])
    with pytest.raises(ConfigError, match="'grpo.loss'.*no_such_module"):
        load_config(preset, ["grpo.loss=no_such_module:loss"])
    assert load_config(preset, ["optim.lr_scheduler=cosine", "grpo.advantage=rloo"]).grpo.advantage == "rloo"


@pytest.mark.parametrize("lr", ["0", "1e-7", "5e-8"])
def test_a_polynomial_schedule_needs_a_peak_lr_above_its_end(tmp_path, lr):
    """transformers' polynomial schedule decays to lr_end 1e-7 and refuses a peak lr at or below it with a
    ValueError the trainer raised as a traceback after the model was built."""
    import torch
    from transformers import get_scheduler

    preset = write(tmp_path / "p.yaml", {"pipeline": "toy_bandit:PIPELINE", "optim": {"lr_scheduler": "polynomial"}})
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=float(lr))
    with pytest.raises(ValueError, match="lr_end"):  # what the check stands in for
        get_scheduler("polynomial", optimizer, num_warmup_steps=0, num_training_steps=10)
    with pytest.raises(ConfigError, match=r"^bad value for 'optim.lr': the polynomial lr_scheduler decays to 1e-07"):
        load_config(preset, [f"optim.lr={lr}"])
    assert load_config(preset, ["optim.lr=1.1e-7"]).optim.lr == 1.1e-7
    assert load_config(preset, ["optim.lr=0", "optim.lr_scheduler=linear"]).optim.lr == 0


def test_a_preset_that_does_not_merge_onto_its_base_names_the_file(tmp_path):
    write(tmp_path / "root.yaml", {"pipeline": "toy_bandit:PIPELINE", "rewards": [{"name": "toy"}]})
    leaf = write(tmp_path / "leaf.yaml", {"base": "root.yaml", "rewards": {"name": "x"}})
    with pytest.raises(ConfigError, match="leaf.yaml does not merge onto its base"):
        read_preset(leaf)


def test_a_base_cycle_names_the_files_of_the_cycle(tmp_path):
    write(tmp_path / "a.yaml", {"base": "b.yaml", "pipeline": "toy_bandit:PIPELINE"})
    write(tmp_path / "b.yaml", {"base": ["a.yaml"]})
    leaf = write(tmp_path / "leaf.yaml", {"base": "a.yaml"})
    with pytest.raises(ConfigError) as err:
        load_config(leaf)
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    assert str(err.value) == f"'base:' cycle in presets: {a} -> {b} -> {a}"
    with pytest.raises(ConfigError, match=r"cycle in presets: .*self\.yaml -> .*self\.yaml$"):
        read_preset(write(tmp_path / "self.yaml", {"base": "./self.yaml"}))


def test_a_missing_or_malformed_base_names_the_preset_that_refers_to_it(tmp_path):
    child = write(tmp_path / "child.yaml", {"base": "nosuchbase.yaml"})
    with pytest.raises(ConfigError) as err:
        read_preset(child)
    assert str(err.value) == f"config file not found: {tmp_path / 'nosuchbase.yaml'} (the base of {child})"
    with pytest.raises(ConfigError, match=r"bad value for 'base' in .*odd\.yaml: expected a file path"):
        read_preset(write(tmp_path / "odd.yaml", {"base": 5}))


def test_a_scalar_where_a_section_belongs_names_the_key(tmp_path):
    preset = write(tmp_path / "p.yaml", {"pipeline": "toy_bandit:PIPELINE", "train": 5})
    with pytest.raises(ConfigError) as err:
        load_config(preset)
    assert str(err.value) == "bad value for 'train': expected a mapping of its keys (a section), got 5"
    preset = write(tmp_path / "q.yaml", {"pipeline": "toy_bandit:PIPELINE", "train": {"max_steps": 3}})
    with pytest.raises(ConfigError, match="'grpo': expected a mapping"):
        load_config(preset, ["grpo=[1, 2]"])
    assert load_config(preset, ["optim={lr: 0.5}"]).optim.lr == 0.5


@pytest.mark.parametrize(("key", "suggestion"), [
    ("nosection.x", None),
    ("no.such.key", None),
    ("trian.max_steps", "train.max_steps"),
    ("train.max_step", "train.max_steps"),
    ("outptu_dir", "output_dir"),
    ("seed.x", "seed"),
])
def test_the_closest_key_is_found_component_by_component(tmp_path, key, suggestion):
    preset = write(tmp_path / "p.yaml", {"pipeline": "toy_bandit:PIPELINE"})
    with pytest.raises(ConfigError) as err:
        load_config(preset, [f"{key}=1"])
    if suggestion is None:
        assert re.fullmatch(rf"unknown key '{key}' \(no valid key is close; the top-level keys are pipeline, "
                            r"output_dir, seed, .*\btrain\b.*\)", str(err.value)), str(err.value)
    else:
        assert str(err.value) == f"unknown key '{key}' (closest valid key: '{suggestion}')"


@pytest.mark.parametrize(("output_dir", "override"), [
    ("runs/x", "output_dir=null"), ("runs/x", "output_dir="), ("runs/x", "output_dir=  "), ("runs/x", "output_dir=~"),
    (None, "seed=1"), ("", "seed=1"),
])
def test_a_null_or_empty_output_dir_is_refused(tmp_path, output_dir, override):
    preset = write(tmp_path / "p.yaml", {"pipeline": "toy_bandit:PIPELINE", "output_dir": output_dir})
    with pytest.raises(ConfigError, match="^bad value for 'output_dir'"):
        load_config(preset, [override])


def test_a_config_path_that_is_a_folder_or_not_text_is_one_line(tmp_path, capsys):
    (tmp_path / "presets").mkdir()
    with pytest.raises(ConfigError, match=r"^config path .*presets is a directory, not a YAML file$"):
        read_preset(tmp_path / "presets")
    binary = tmp_path / "weights.yaml"
    binary.write_bytes(b"\x00\xff\xfe\x80 not text")
    with pytest.raises(ConfigError, match=r"^cannot parse .*weights\.yaml: "):
        read_preset(binary)
    assert main(["config", str(binary)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: cannot parse"), lines


def test_missing_file_and_missing_pipeline(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="'pipeline'"):
        load_config(write(tmp_path / "p.yaml", {"seed": 3}))
    with pytest.raises(ConfigError, match="unknown pipeline 'flwo'"):
        load_config(write(tmp_path / "q.yaml", {"pipeline": "flwo"}))


def test_reward_args_are_checked_against_the_reward(tmp_path):
    # the config schema leaves a reward's args open; validation checks them against the reward's constructor
    preset = write(tmp_path / "p.yaml", {"pipeline": "toy_bandit:PIPELINE",
                                         "rewards": [{"name": "format", "args": {"think_tag": "reason"}}]})
    cfg = load_config(preset)
    assert cfg.rewards[0].args == {"think_tag": "reason"}
    assert valid_keys(BaseConfig)["rewards"] is False
    with pytest.raises(ConfigError, match="unknown key 'rewards.0.args.think_tg' for reward 'format' "
                                          "\\(closest: 'think_tag'\\)"):
        load_config(preset, ["rewards.0.args.think_tg=x"])


def test_exponent_numbers_are_floats_in_free_form_args_too(tmp_path):
    """YAML 1.1 reads ``1e-3`` (no dot) as a string: typed keys convert it, a reward's free-form args would not."""
    preset = tmp_path / "p.yaml"
    preset.write_text("pipeline: toy_bandit:PIPELINE\noptim: {lr: 5e-4}\n"
                      "rewards: [{name: sharpness, args: {saturate_at: 1e-3}}]\n")
    cfg = load_config(preset)
    assert cfg.optim.lr == 5e-4 and cfg.rewards[0].args == {"saturate_at": 1e-3}
    assert load_config(preset, ["rewards.0.args.saturate_at=2E-3"]).rewards[0].args == {"saturate_at": 2e-3}
    text = load_config(preset, ["output_dir=1e-3"])  # a string field that looks like a number stays a string
    saved = tmp_path / "saved.yaml"
    saved.write_text(to_yaml(text))
    assert load_config(saved).output_dir == "1e-3"


def test_an_unknown_key_in_a_reward_item_of_a_preset_names_its_path(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("pipeline: toy_bandit:PIPELINE\nrewards: [{name: format}, {name: accuracy, wieght: 1}]\n")
    with pytest.raises(ConfigError, match=r"^unknown key 'rewards\.1\.wieght' \(closest: 'weight'\)$"):
        load_config(preset)


@pytest.mark.parametrize(("override", "message"), [
    ("rewards.0.wieght=2", "unknown key 'rewards.0.wieght' (closest valid key: 'rewards.0.weight')"),
    ("rewards.0.weight.x=2", "unknown key 'rewards.0.weight.x' (closest valid key: 'rewards.0.weight')"),
    ("rewards.0={name: format, wieght: 1}", "unknown key 'rewards.0.wieght' (closest: 'weight')"),
])
def test_an_unknown_key_of_a_reward_item_in_an_override_names_the_closest_item_key(tmp_path, override, message):
    """The override forms said "closest valid key: 'rewards'" (the item's keys were not candidates), or 'bad
    value' with OmegaConf's own sentence."""
    preset = write(tmp_path / "p.yaml", {"pipeline": "toy_bandit:PIPELINE", "rewards": [{"name": "format"}]})
    with pytest.raises(ConfigError) as err:
        load_config(preset, [override])
    assert str(err.value) == message
    assert load_config(preset, ["rewards.0.weight=2", "rewards.0.args.think_tag=t"]).rewards[0].weight == 2


@pytest.mark.parametrize("override", ["rewards=[{name: format}, {weight: 2}]", None])
def test_a_missing_key_of_a_list_item_is_named_dotted(tmp_path, override):
    """OmegaConf names it 'rewards[1].name'; every other message, and the overrides, say rewards.1.name."""
    preset = tmp_path / "p.yaml"
    preset.write_text("pipeline: toy_bandit:PIPELINE\nrewards: [{name: format}, {weight: 2}]\n")
    with pytest.raises(ConfigError) as err:
        load_config(preset, [override] if override else [])
    assert str(err.value) == "missing required key 'rewards.1.name'"


def test_a_key_given_twice_in_a_preset_is_an_error_not_a_dropped_section(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("pipeline: toy_bandit:PIPELINE\ntrain:\n  max_steps: 7\noptim:\n  lr: 0.1\ntrain:\n"
                      "  group_size: 4\n")
    with pytest.raises(ConfigError, match=r"cannot parse .*p\.yaml: .*duplicate key 'train' \(first at line 2\)"
                                          r".*line 6"):
        load_config(preset)
    preset.write_text("pipeline: toy_bandit:PIPELINE\nrewards: [{name: format, weight: 1, weight: 2}]\n")
    with pytest.raises(ConfigError, match="duplicate key 'weight'"):
        load_config(preset)


def test_output_dir_and_resume_paths_expand_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    preset = write(tmp_path / "p.yaml", {"pipeline": "toy_bandit:PIPELINE", "output_dir": "~/runs/x"})
    cfg = load_config(preset, ["resume=~/runs/old/checkpoints/step-2"])
    assert cfg.output_dir == f"{tmp_path}/runs/x" and cfg.resume == f"{tmp_path}/runs/old/checkpoints/step-2"
    assert load_config(preset, ["resume=latest"]).resume == "latest"


def test_resolved_config_round_trips(tmp_path):
    preset = write(tmp_path / "p.yaml", {"pipeline": "toy_bandit:PIPELINE", "seed": 11})
    cfg = load_config(preset, ["train.max_steps=9"])
    saved = write(tmp_path / "saved.yaml", yaml.safe_load(to_yaml(cfg)))
    again = load_config(saved)
    assert again == cfg


def test_cli_exits_2_with_one_line_naming_the_key(tmp_path, support_env):
    preset = write(tmp_path / "p.yaml", {"pipeline": "toy_bandit:PIPELINE"})
    proc = subprocess.run([sys.executable, "-m", "mmgrpo", "train", str(preset), "no.such.key=1"],
                          capture_output=True, text=True, timeout=120, env=support_env, check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no.such.key" in lines[0], proc.stderr


@pytest.mark.parametrize(("preset", "missing"), [("configs/vlm/tiny_image.yaml", "data file not found"),
                                                 ("configs/flow/tiny_flowgrpo.yaml", "cannot load hub id")])
def test_a_preset_run_outside_the_repository_says_where_it_looked(tmp_path, monkeypatch, capsys, preset, missing):
    """The presets name the shipped assets relative to the repository root; started from another folder, the
    one-line error says which working directory the relative path was looked for under."""
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)
    assert main(["train", str(root / preset), f"output_dir={tmp_path}/run", "logging.progress=false"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert missing in last and f"looked for under the working directory {tmp_path}:" in last, last


def test_override_values_string_fields_verbatim_lists_by_index(tmp_path):
    preset = write(tmp_path / "p.yaml", {"pipeline": "toy_bandit:PIPELINE",
                                         "rewards": [{"name": "format"}, {"name": "accuracy", "weight": 2.0}]})
    cfg = load_config(preset, ["output_dir={question}: a/b", "rewards.1.weight=0.5", "rewards.0.name=sharpness",
                               "resume=null", "optim.betas=[0.8, 0.95]", "grpo.clip_eps_high=0.28"])
    assert cfg.output_dir == "{question}: a/b"
    assert [(r.name, r.weight) for r in cfg.rewards] == [("sharpness", 1.0), ("accuracy", 0.5)]
    assert cfg.resume is None and cfg.optim.betas == [0.8, 0.95] and cfg.grpo.clip_eps_high == 0.28
    with pytest.raises(ConfigError, match="rewards"):
        load_config(preset, ["rewards.5.weight=1"])
    with pytest.raises(ConfigError, match="'optim.lr'"):
        load_config(preset, ["optim.lr=[1, 2"])


@dataclass
class _Parent:
    """A section."""

    size: int = 1
    """Documented on the parent."""


@dataclass
class _Child(_Parent):
    """A subclass that adds a field."""

    section: _Parent = None
    name: str = "x"
    """Documented on the child."""


@pytest.mark.parametrize(("allowed", "text", "inside", "outside"), [
    (Range(0), ">= 0", [0, 0.0, 3], [-1, -1e-9, float("nan")]),
    (Range(0, low_open=True), "> 0", [1e-9, 5], [0, -1, float("nan")]),
    (Range(0, 1, high_open=True), "in [0, 1)", [0, 0.999], [1, -0.1, float("nan")]),
    (Range(0, 1, low_open=True), "in (0, 1]", [1, 0.5], [0, 1.01]),
    (Range(high=2), "<= 2", [2, -100], [2.5, float("nan"), float("-inf")]),
    (Range(), "a finite number", [0, -3.5, 1e30], [float("inf"), float("nan")]),
])
def test_a_range_holds_its_values_and_says_what_they_are(allowed, text, inside, outside):
    assert str(allowed) == text
    assert all(allowed.holds(v) for v in inside)
    assert not any(allowed.holds(v) for v in outside)


def test_a_seed_beyond_what_numpy_takes_is_refused_at_load(tmp_path):
    """accelerate's set_seed seeds numpy, which takes seeds below 2**32 and raised a ValueError traceback when the
    trainer started (seed + rank: the last seeds crash only the other processes)."""
    from accelerate.utils import set_seed

    with pytest.raises(ValueError, match="2\\*\\*32"):
        set_seed(2**32)
    preset = write(tmp_path / "p.yaml", {"pipeline": "toy_bandit:PIPELINE"})
    with pytest.raises(ConfigError, match=r"^bad value for 'seed': must be in \[0, 2147483647\], got 4294967296$"):
        load_config(preset, [f"seed={2**32}"])
    assert load_config(preset, [f"seed={2**31 - 1}"]).seed == 2**31 - 1


def just_outside(allowed: Range, integer: bool) -> float:
    """A value next to the range, on the side of its lower bound (or upper, when it has none below)."""
    if allowed.low is not None:
        return allowed.low if allowed.low_open else allowed.low - (1 if integer else 0.5)
    return allowed.high if allowed.high_open else allowed.high + (1 if integer else 0.5)


def get_section(schema: type, key: str) -> type:
    """The dataclass that declares the last component of a dotted key."""
    for part in key.split(".")[:-1]:
        schema = typing.get_type_hints(schema)[part]
    return schema


PRESETS = {"flow": "configs/flow/tiny_flowgrpo.yaml", "vlm": "configs/vlm/tiny_image.yaml"}


@pytest.mark.parametrize("pipeline", sorted(PRESETS))
def test_every_ranged_key_refuses_a_value_outside_its_range(pipeline, monkeypatch):
    """A negative KL weight or a NaN learning rate used to train silently; every key declared with a range now
    refuses a value next to it, and NaN for a float, with one line that names the key."""
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # the presets name their files from the repo root
    schema = PIPELINES.get(pipeline).config_class
    ranges = key_ranges(schema)
    assert {"grpo.kl_beta", "optim.lr", "train.group_size", "train.max_minutes"} <= set(ranges)
    for override, shown in (("grpo.kl_beta=-1", "grpo.kl_beta': must be >= 0, got -1.0"),
                            ("optim.lr=nan", "optim.lr': must be >= 0, got nan")):  # through the whole load
        with pytest.raises(ConfigError, match=re.escape(f"bad value for '{shown}")):
            load_config(PRESETS[pipeline], [override])
    cfg = load_config(PRESETS[pipeline])  # the preset itself is in range
    for key, allowed in ranges.items():
        section_key, name = key.rsplit(".", 1) if "." in key else ("", key)
        declared = str(typing.get_type_hints(get_section(schema, key))[name])
        integer = "int" in declared and "float" not in declared
        for value in [just_outside(allowed, integer)] + ([] if integer else [float("nan")]):
            bad = copy.deepcopy(cfg)
            setattr(get_key(bad, section_key) if section_key else bad, name, [value] if "list" in declared else value)
            with pytest.raises(ConfigError, match=re.escape(f"bad value for '{key}': must be {allowed}, got")):
                check_ranges(bad)


def test_list_values_are_checked_item_by_item(tmp_path):
    preset = write(tmp_path / "p.yaml", {"pipeline": "toy_bandit:PIPELINE"})
    with pytest.raises(ConfigError, match=r"'optim.betas': expected two values"):
        load_config(preset, ["optim.betas=[0.9]"])
    with pytest.raises(ConfigError, match=r"'optim.betas': must be in \[0, 1\)"):
        load_config(preset, ["optim.betas=[0.9,1.0]"])
    assert load_config(preset, ["grpo.clip_eps_high=null"]).grpo.clip_eps_high is None  # unset optional: passes
    rewards = write(tmp_path / "r.yaml", {"pipeline": "toy_bandit:PIPELINE",
                                          "rewards": [{"name": "format"}, {"name": "accuracy", "weight": 0.5}]})
    assert load_config(rewards, ["rewards.1.weight=-2"]).rewards[1].weight == -2  # a weight may pay against
    with pytest.raises(ConfigError, match=r"bad value for 'rewards.1.weight': must be a finite number, got nan"):
        load_config(rewards, ["rewards.1.weight=nan"])


def test_key_docs_reads_field_docstrings_through_the_mro_and_sections():
    docs = key_docs(_Child)
    assert list(docs) == ["size", "section", "section.size", "name"]
    assert docs["size"] == docs["section.size"] == "Documented on the parent."
    assert docs["name"] == "Documented on the child."
    assert docs["section"] == "A section."  # no docstring of its own: the section class's first line


@pytest.mark.parametrize("pipeline", PIPELINES.names())
def test_every_option_of_every_pipeline_is_documented(pipeline):
    schema = PIPELINES.get(pipeline).config_class
    docs = key_docs(schema)
    assert list(docs) == list(valid_keys(schema))
    assert [key for key, doc in docs.items() if not doc] == []


def test_config_command_shows_resolved_values_with_their_docs(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    preset = Path(__file__).resolve().parents[2] / "configs" / "flow" / "tiny_flowgrpo.yaml"
    assert main(["config", str(preset), "train.max_steps=7", "--grep", "max_steps"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "train.max_steps" in line)
    assert " 7 " in row and "Optimiser steps to run in total" in row
    assert "optim.lr" not in out  # --grep keeps only the matching options
    assert main(["config", str(preset), "no.such.key=1"]) == 2
    capsys.readouterr()
    assert main(["config", "vlm", "--grep", "media_types"]) == 0  # a pipeline name: its defaults
    row = next(line for line in capsys.readouterr().out.splitlines() if "data.media_types" in line)
    assert "[image, video, text]" in row  # a list value is shown, not taken for markup
    assert main(["config", "vlm", "seed=1"]) == 2


def test_config_command_takes_a_pipeline_name_beside_a_folder_of_that_name(tmp_path, capsys, monkeypatch):
    """``mmgrpo config flow`` run in configs/ or pipelines/ (each has a flow/ folder) shows the defaults."""
    (tmp_path / "flow").mkdir()
    monkeypatch.chdir(tmp_path)
    assert main(["config", "flow", "--grep", "train.max_steps"]) == 0
    assert "flow pipeline defaults" in capsys.readouterr().out


def test_config_command_piped_keeps_rows_whole_and_says_when_nothing_matches(capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)  # output to a pipe (capsys), no width given
    assert main(["config", "flow", "--grep", "train.max_steps"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if "train.max_steps" in line)
    assert "Optimiser steps to run in total" in row  # rich wrapped the description at 80 columns
    assert main(["config", "flow", "--grep", "zzzz"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.strip() == ("no option of flow pipeline defaults (??? = required) "
                                                          "matches 'zzzz' (in its key or its description)")


def test_a_second_ctrl_c_is_one_line_and_warnings_have_no_source_line(capsys, monkeypatch):
    import warnings

    from mmgrpo import cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_rewards", interrupted)
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # main sets the CLI's; undone after
    assert cli.main(["rewards"]) == 130
    assert capsys.readouterr().err == "interrupted\n"
    line = warnings.formatwarning("a clip could not be decoded: skipped", UserWarning, "data.py", 7, "src line")
    assert line == "UserWarning: a clip could not be decoded: skipped\n"


def test_yaml_scalars_follow_the_yaml_1_2_core_schema(tmp_path):
    """PyYAML reads YAML 1.1: ``010`` was octal 8, ``12:30`` base-60 750, ``on``/``yes``/``off``/``no`` booleans
    (a string key given ``on`` held 'True') and ``2024-01-01`` a date. The YAML 1.2 core schema reads decimal
    ints, floats with a dot or an exponent, only true/false as booleans, and everything else as strings."""
    text = "[010, 12:30, on, off, yes, no, 2024-01-01, 1_000, 0o17, 0x1F, true, FALSE, null, ~, 1e-3, 2., -.5, .inf]"
    assert load_yaml(text) == [10, "12:30", "on", "off", "yes", "no", "2024-01-01", "1_000", 15, 31,
                               True, False, None, None, 1e-3, 2.0, -0.5, float("inf")]
    assert load_yaml("a: =") == {"a": "="}  # YAML 1.1's value key: PyYAML had no constructor for it
    preset = tmp_path / "p.yaml"
    preset.write_text("pipeline: toy_bandit:PIPELINE\noutput_dir: on\nseed: 010\nlogging: {progress: off}\n"
                      "rewards: [{name: format, args: {think_tag: 12:30}}]\n")
    cfg = load_config(preset)
    assert (cfg.output_dir, cfg.seed, cfg.rewards[0].args) == ("on", 10, {"think_tag": "12:30"})
    assert cfg.logging.progress is False  # a boolean key still takes off/on (OmegaConf converts the string)
    cfg = load_config(preset, ["seed=012", "rewards.0.args.think_tag=on", "train.max_steps=0x10"])
    assert (cfg.seed, cfg.rewards[0].args, cfg.train.max_steps) == (12, {"think_tag": "on"}, 16)
    with pytest.raises(ConfigError, match="^bad value for 'train.max_steps'"):
        load_config(preset, ["train.max_steps=1:30"])


def test_a_quoted_override_value_is_the_unquoted_string(tmp_path):
    """``output_dir='runs/x'`` (as Python callers pass it) kept the quotes in a string key; now a value that is one
    YAML-quoted scalar is that string, by YAML's quoting rules, and an unquoted one is still verbatim."""
    preset = write(tmp_path / "p.yaml", {"pipeline": "toy_bandit:PIPELINE", "rewards": [{"name": "format"}]})
    cfg = load_config(preset, ["output_dir='runs/x'", 'resume="latest"', "rewards.0.name='accuracy'"])
    assert (cfg.output_dir, cfg.resume, cfg.rewards[0].name) == ("runs/x", "latest", "accuracy")
    assert load_config(preset, ["rewards.0.args.think_tag='on'"]).rewards[0].args == {"think_tag": "on"}
    for value, expected in [("'it''s: {a}'", "it's: {a}"), ('"tab\\there"', "tab\there"),
                            ("'a' and 'b'", "'a' and 'b'"), ("'a' # c'", "'a' # c'"), ("it's", "it's"),
                            ("'", "'"), ("{q}: 'x'", "{q}: 'x'")]:
        assert load_config(preset, [f"output_dir={value}"]).output_dir == expected, value
    assert load_config(preset, ["resume='null'"]).resume == "null" and load_config(preset, ["resume=null"]).resume is None


@pytest.mark.parametrize(("text", "override", "message"), [
    ("[{name: format}, {name: accuracy, weight: abc}]", None,
     r"bad value for 'rewards\.1\.weight': Value 'abc' of type 'str' could not be converted to Float"),
    ("[{name: format, args: 5}]", None, r"bad value for 'rewards\.0\.args': Cannot assign int to Dict"),
    ("[5]", None, r"bad value for 'rewards\.0': Invalid type assigned: int is not a subclass of RewardSpec"),
    ("[{name: format}]", "rewards=[{name: format}, {name: accuracy, weight: q}]", r"bad value for 'rewards\.1\.weight'"),
    ("[{name: format}]", "rewards.0.weight=q", r"bad value for 'rewards\.0\.weight'"),
    ("[{name: format}]", "rewards.0={name: format, weight: q}", r"bad value for 'rewards\.0\.weight'"),
])
def test_a_wrong_typed_key_of_a_reward_item_names_the_item_and_the_key(tmp_path, text, override, message):
    """A preset's ``{name: accuracy, weight: abc}`` said only "bad value for 'weight'" (which reward? which
    list?); an override said 'rewards[1].weight'. Now each names the dotted key, in one line."""
    preset = tmp_path / "p.yaml"
    preset.write_text(f"pipeline: toy_bandit:PIPELINE\nrewards: {text}\n")
    with pytest.raises(ConfigError) as err:
        load_config(preset, [override] if override else [])
    assert re.match(message, str(err.value)) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize(("override", "shown"), [
    ("rewards.1.weight=2", "'rewards.1.weight': 'rewards' has 1 item"),
    ("rewards.1={name: accuracy}", "'rewards.1': 'rewards' has 1 item"),
    ("optim.betas.2=0.1", "'optim.betas.2': 'optim.betas' has 2 items"),
    ("optim.betas.7.x=1", "'optim.betas.7.x': 'optim.betas' has 2 items"),
])
def test_an_override_past_the_end_of_a_list_says_how_long_the_list_is(tmp_path, override, shown):
    """``rewards.1.weight=2`` on a preset with one reward said "Invalid type assigned: dict is not a subclass of
    RewardSpec. value: {}"; every index past the end now says the same one line."""
    preset = write(tmp_path / "p.yaml", {"pipeline": "toy_bandit:PIPELINE", "rewards": [{"name": "format"}]})
    with pytest.raises(ConfigError) as err:
        load_config(preset, [override])
    assert str(err.value).startswith(f"bad value for {shown}; an override changes an item the list has or sets "
                                     "the whole list"), str(err.value)

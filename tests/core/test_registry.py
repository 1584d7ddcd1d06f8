import sys
import warnings

import pytest

from mmgrpo.registry import ADVANTAGES, Registry, RegistryError, import_path


def sample_factory():
    return 42


def test_register_get_and_module_attr_path():
    reg = Registry("widget")
    reg.register("answer", sample_factory, kind="pointwise")
    assert reg.build("answer") == 42
    assert reg.entry("answer").info == {"kind": "pointwise"}
    assert reg.get("mmgrpo.registry:import_path") is import_path
    assert ADVANTAGES.get("mmgrpo.grpo.advantages:group_zscore") is ADVANTAGES.get("group_zscore")


def test_unknown_name_suggests_closest():
    reg = Registry("widget")
    reg.register("group_zscore", sample_factory)
    with pytest.raises(RegistryError, match="unknown widget 'group_zscor'; did you mean 'group_zscore'"):
        reg.get("group_zscor")


def test_bad_import_paths_have_clear_messages():
    with pytest.raises(RegistryError, match="cannot import module 'no_such_module_xyz'"):
        import_path("no_such_module_xyz:thing")
    with pytest.raises(RegistryError, match="has no attribute 'nope'"):
        import_path("mmgrpo.registry:nope")


def test_duplicate_registration_is_refused():
    reg = Registry("widget")
    reg.register("a", sample_factory)
    with pytest.raises(RegistryError, match="already registered"):
        reg.register("a", lambda: 1)


def test_builtin_registries_are_populated():
    assert {"group_zscore", "group_mean", "group_mean_batch_std", "rloo"} <= set(ADVANTAGES.names())
    from mmgrpo.registry import POLICY_LOSSES

    assert {"ppo_clip", "reinforce"} <= set(POLICY_LOSSES.names())


def test_an_import_that_raises_is_one_line_naming_the_path_and_file_line(tmp_path, monkeypatch):
    (tmp_path / "broken_syntax_mod.py").write_text("x = 1\ndef fn(batch:\n")
    (tmp_path / "raises_at_import_mod.py").write_text("raise RuntimeError('no GPU\\nfound')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RegistryError) as err:
        import_path("broken_syntax_mod:fn")
    msg = str(err.value)
    assert "'broken_syntax_mod:fn'" in msg and "broken_syntax_mod.py:2: SyntaxError" in msg and "\n" not in msg
    with pytest.raises(RegistryError, match=r"'raises_at_import_mod:fn'.*RuntimeError: no GPU found$"):
        import_path("raises_at_import_mod:fn")


def test_a_python_file_path_imports_that_file_once(tmp_path, monkeypatch):
    reward_file = tmp_path / "my reward.py"
    reward_file.write_text("def fn(batch):\n    return [1.0] * len(batch.prompts)\n")
    reg = Registry("widget")
    fn = reg.get(f"{reward_file}:fn")
    assert fn.__name__ == "fn" and reg.entry(f"{reward_file}:fn").obj is fn  # the module is reused
    monkeypatch.chdir(tmp_path.parent)
    assert reg.get(f"{tmp_path.name}/my reward.py:fn") is fn  # relative to the current directory
    with pytest.raises(RegistryError, match="cannot import module 'nope.py'.*nope.py"):
        reg.get("nope.py:fn")
    with pytest.raises(RegistryError, match="has no attribute 'gn'"):
        reg.get(f"{reward_file}:gn")


def test_a_module_in_the_current_directory_off_the_import_path_hints_the_file_form(tmp_path, monkeypatch):
    (tmp_path / "cwd_only_rewards.py").write_text("def fn(batch):\n    return [0.0]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    with pytest.raises(RegistryError, match=r"name the file: 'cwd_only_rewards.py:fn'"):
        import_path("cwd_only_rewards:fn")
    assert import_path("cwd_only_rewards.py:fn")([]) == [0.0]


def test_a_reward_file_works_through_the_zoo(tmp_path):
    import torch

    from mmgrpo.config import RewardSpec
    from mmgrpo.rewards import RewardBatch, RewardZoo

    reward_file = tmp_path / "length_reward.py"
    reward_file.write_text("def length(batch):\n    return [float(len(c)) for c in batch.completions]\n")
    zoo = RewardZoo([RewardSpec(name=f"{reward_file}:length", weight=1.0)])
    batch = RewardBatch(prompts=["p", "p"], group=torch.tensor([0, 0]), completions=["ab", "abcd"])
    main, _, _ = zoo(batch)
    assert main[:, 0].tolist() == [2.0, 4.0]


@pytest.mark.parametrize("path", [r"C:\Users\me\rewards.py", "C:/Users/me/rewards.py", "my_rewards.py:",
                                  "pkg.mod:fn()"])
def test_a_file_or_drive_path_without_an_attribute_says_so(path):
    """'C:\\...\\rewards.py' split at the drive's colon into module 'C' and attribute '\\...\\rewards.py': the error
    was 'cannot import module C', about a module nobody named."""
    with pytest.raises(RegistryError) as err:
        Registry("widget").get(path)
    msg = str(err.value)
    assert msg.startswith(f"'{path}' is not an import path of the form package.module:attribute or "
                          "path/to/file.py:attribute") and "\n" not in msg and "module 'C'" not in msg


def _install(site, dist, group, entries):
    """A distribution ``dist`` in the folder ``site`` (put on sys.path) with entry points ``name = value``."""
    info = site / f"{dist}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()))


def test_an_entry_point_whose_name_is_taken_is_skipped_with_a_warning(tmp_path, monkeypatch):
    """A plug-in named like a built-in, or like another plug-in, was skipped in silence: a run asking for it got the
    other component and no word about it."""
    (tmp_path / "widget_plugins_mod.py").write_text("def one():\n    return 1\n\ndef two():\n    return 2\n")
    _install(tmp_path, "plugin_a", "mmgrpo.test_widgets", {"answer": "widget_plugins_mod:one",
                                                          "shared": "widget_plugins_mod:one"})
    _install(tmp_path, "plugin_b", "mmgrpo.test_widgets", {"shared": "widget_plugins_mod:two"})
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry("widget", entry_point_group="mmgrpo.test_widgets")
    reg.register("answer", sample_factory)
    with pytest.warns(RuntimeWarning) as caught:
        names = reg.names()
    assert names == ["answer", "shared"] and reg.build("answer") == 42
    kept = reg.entry("shared").info["source"].removeprefix("entry point ")
    skipped = ({"widget_plugins_mod:one", "widget_plugins_mod:two"} - {kept}).pop()
    assert sorted(str(w.message) for w in caught) == [
        f"widget entry point {name} = {value} is skipped: '{name}' is already a widget (use '{value}' to reach "
        "the plug-in)" for name, value in (("answer", "widget_plugins_mod:one"), ("shared", skipped))]


def test_an_entry_point_to_the_object_registered_under_its_name_is_not_a_clash(tmp_path, monkeypatch):
    """A plug-in whose module registers itself too, imported before the registry is read, is the same component."""
    _install(tmp_path, "plugin_c", "mmgrpo.test_widgets", {"answer": f"{__name__}:sample_factory"})
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry("widget", entry_point_group="mmgrpo.test_widgets")
    reg.register("answer", sample_factory)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert reg.names() == ["answer"]

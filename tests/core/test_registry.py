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

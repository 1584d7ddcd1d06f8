"""Rollout modes: the plans each recipe produces, their config errors, and the BranchGRPO tree rollout."""

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from random_flow import RANDOM_TINY_SD3

from mmgrpo.config import ConfigError, load_config
from mmgrpo.pipelines.flow.config import FlowConfig
from mmgrpo.pipelines.flow.modes import LinearPlan, TreePlan, build_mode, sde_kernel

BASE = Path(__file__).resolve().parents[2] / "configs" / "flow" / "tiny_base.yaml"


def config(*overrides):
    return load_config(BASE, [*RANDOM_TINY_SD3, "output_dir=/tmp/unused", *overrides])


def plan(overrides, iteration=0, groups=2, group_size=4, seed=0):
    cfg = config(*overrides, f"train.group_size={group_size}")
    return build_mode(cfg).plan(iteration, groups, group_size, torch.Generator().manual_seed(seed))


def test_flow_grpo_plan_is_sde_everywhere_and_trains_the_first_fraction():
    p = plan(["mode.name=flow_grpo", "mode.train_fraction=0.9"])
    assert isinstance(p, LinearPlan) and p.sde.shape == (8, 10) and bool(p.sde.all())
    assert (p.train_steps == torch.arange(9)).all() and p.main_steps == 10


def test_dance_grpo_trains_a_random_subset_per_sample():
    p = plan(["mode.name=dance_grpo", "mode.train_fraction=0.6"], groups=4)
    assert bool(p.sde.all()) and p.train_steps.shape == (16, 6)
    assert all(len(set(row.tolist())) == 6 for row in p.train_steps)
    assert len({tuple(row.tolist()) for row in p.train_steps}) > 1  # per sample, not per batch
    unit_of = p.unit_of()
    assert (unit_of >= 0).sum(dim=1).tolist() == [6] * 16
    assert unit_of[0, p.train_steps[0, 3]] == 3


def test_cps_never_trains_the_deterministic_last_step():
    p = plan(["mode.name=dance_grpo", "mode.train_fraction=1.0", "sampling.sde=cps"])
    assert p.train_steps.shape[1] == 9 and int(p.train_steps.max()) == 8


def test_fast_window_lies_in_the_first_half():
    for it in range(10):
        p = plan(["mode.name=fast", "mode.window_size=2", "mode.fast_within=0.5"], iteration=it)
        window = p.train_steps[0].tolist()
        assert len(window) == 2 and window[1] == window[0] + 1 and window[1] < 5
        assert p.sde[0].nonzero().flatten().tolist() == window


def test_mixgrpo_window_slides_with_the_iteration():
    overrides = ["mode.name=mixgrpo", "mode.window_size=2", "mode.shift_interval=3", "mode.window_stride=1"]
    starts = [int(plan(overrides, iteration=it).train_steps[0, 0]) for it in range(0, 12, 3)]
    assert starts == [0, 1, 2, 3]
    p = plan(overrides, iteration=3)
    assert p.sde[0].tolist() == [False, True, True] + [False] * 7 and p.solver_after == "euler"


def test_mixgrpo_flash_runs_dpm_on_compressed_steps_after_the_window():
    p = plan(["mode.name=mixgrpo_flash", "mode.window_size=2", "mode.flash_compression=0.4"])
    assert p.solver_after == "dpm2" and p.main_steps == 2
    assert p.ode_sigmas_after == (2, 5, 7, 10)  # 3 of the 8 remaining steps


def test_tempflow_has_one_sde_step_shared_by_a_group():
    p = plan(["mode.name=tempflow"], groups=6)
    assert p.shared_noise and p.train_steps.shape == (24, 1)
    assert p.sde.sum(dim=1).tolist() == [1] * 24
    k = p.train_steps[:, 0].view(6, 4)
    assert bool((k == k[:, :1]).all()) and int(k.max()) < 9  # the last step is not a candidate
    assert (p.sde.float().argmax(dim=1) == p.train_steps[:, 0]).all()


@pytest.mark.parametrize("name", ["flow_grpo", "dance_grpo", "fast", "mixgrpo", "mixgrpo_flash"])
def test_shared_initial_noise_is_an_option_of_every_chain_mode(name):
    assert not plan([f"mode.name={name}", "mode.window_size=2"]).shared_noise
    assert plan([f"mode.name={name}", "mode.window_size=2", "mode.shared_initial_noise=true"]).shared_noise


def test_branch_plan_trains_owned_nodes_with_depth_pruning():
    p = plan(["mode.name=branch", "mode.split_points=[2,4,6]", "mode.depth_prune_window=3",
              "mode.width_keep=0.5"], group_size=8)
    assert isinstance(p, TreePlan)
    assert p.train_steps == (2, 3, 4, 5, 6)  # root steps 0-1 carry no advantage; 7-9 depth-pruned
    assert p.unit_depths() == [1, 1, 2, 2, 3]
    owners = p.owners()
    assert owners.sum(dim=0).tolist() == [2, 2, 4, 4, 8]  # one owner leaf per node
    assert owners[:, 0].nonzero().flatten().tolist() == [0, 4]
    assert p.ancestor(1).tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


MAX_UNITS = {  # (overrides, the most trained steps one sample has, which some iteration reaches)
    "flow_grpo": (["mode.name=flow_grpo", "mode.train_fraction=0.9"], 9),
    "flow_grpo_cps": (["mode.name=flow_grpo", "mode.train_fraction=1.0", "sampling.sde=cps"], 9),
    "dance_grpo": (["mode.name=dance_grpo", "mode.train_fraction=0.6"], 6),
    "dance_grpo_cps": (["mode.name=dance_grpo", "mode.train_fraction=1.0", "sampling.sde=cps"], 9),
    "fast": (["mode.name=fast", "mode.window_size=3"], 3),
    "fast_cps_whole_schedule": (["mode.name=fast", "mode.window_size=10", "mode.fast_within=1.0",
                                 "sampling.sde=cps"], 9),
    "mixgrpo_cps": (["mode.name=mixgrpo", "mode.window_size=4", "mode.shift_interval=1", "sampling.sde=cps"], 4),
    "mixgrpo_stride_3_cps": (["mode.name=mixgrpo", "mode.window_size=4", "mode.shift_interval=1",
                              "mode.window_stride=3", "sampling.sde=cps"], 4),
    "mixgrpo_random_cps": (["mode.name=mixgrpo", "mode.window_size=4", "mode.window_strategy=random",
                            "sampling.sde=cps"], 4),
    "mixgrpo_decay_cps": (["mode.name=mixgrpo", "mode.window_size=4", "mode.window_strategy=decay",
                           "mode.shift_interval=2", "sampling.sde=cps"], 4),
    "mixgrpo_flash_cps": (["mode.name=mixgrpo_flash", "mode.window_size=4", "mode.shift_interval=1",
                           "sampling.sde=cps"], 4),
    "tempflow": (["mode.name=tempflow"], 1),
    "branch_pruned": (["mode.name=branch", "mode.split_points=[2,4,6]", "mode.depth_prune_window=3",
                       "mode.depth_prune_interval=1", "train.group_size=8"], 5),
    # cps: the window first covers the untrained last step (5 units), then 3 trained ones (4 units)
    "branch_pruned_cps": (["mode.name=branch", "mode.split_points=[2,4,6]", "mode.depth_prune_window=3",
                           "mode.depth_prune_interval=1", "train.group_size=8", "sampling.sde=cps"], 5),
    "branch_mix": (["mode.name=branch", "mode.split_points=[1,2]", "mode.branch_variant=mix",
                    "mode.window_size=4", "train.group_size=4", "mode.width_keep=0.5"], 3),
}


@pytest.mark.parametrize("case", list(MAX_UNITS))
def test_max_units_is_the_widest_mask_of_any_iteration(case):
    """Dr. GRPO's sum-norm divides by ``max_units``: a constant of the config that no rollout's mask exceeds and
    some rollout reaches (the rollout's own width changes: a cps window at the end trains one step less)."""
    overrides, expected = MAX_UNITS[case]
    cfg = config(*overrides)
    mode = build_mode(cfg)
    group_size = cfg.train.group_size
    widths = set()
    for iteration in range(60):
        p = mode.plan(iteration, 2, group_size, torch.Generator().manual_seed(iteration))
        if isinstance(p, TreePlan):  # leaf-row layout: a row trains the units it owns
            widths.add(int(p.owners().sum(dim=1).max()) if p.train_steps else 0)
        else:
            widths.add(p.train_steps.shape[1])
    assert mode.max_units() == expected == max(widths)


@pytest.mark.parametrize("overrides", [
    ["mode.name=mixgrpo", "mode.shift_interval=1"],
    ["mode.name=mixgrpo", "mode.window_strategy=random"],
    ["mode.name=mixgrpo_flash", "mode.shift_interval=1"],
    ["mode.name=fast", "mode.fast_within=1.0"],
])
def test_a_cps_window_that_can_reach_only_the_last_step_fails_when_the_config_loads(overrides):
    """A 1-step window on the last step trains nothing with cps: a config error, not a crash at that iteration."""
    with pytest.raises(ConfigError, match="'mode.window_size'") as err:
        config(*overrides, "mode.window_size=1", "sampling.sde=cps")
    assert "\n" not in str(err.value)


def test_a_cps_window_whose_stride_skips_the_last_step_trains_one_step_at_every_iteration():
    mode = build_mode(config("mode.name=mixgrpo", "mode.window_size=1", "mode.shift_interval=1",
                             "mode.window_stride=2", "sampling.sde=cps"))  # starts 0, 2, 4, 6, 8
    starts = {int(mode.plan(it, 1, 8, torch.Generator()).train_steps[0, 0]) for it in range(10)}
    assert starts == {0, 2, 4, 6, 8}


@pytest.mark.parametrize(("overrides", "key"), [
    (["mode.name=nope"], "mode.name"),
    (["sampling.sde=ito"], "sampling.sde"),
    (["mode.name=mixgrpo", "mode.window_size=11"], "mode.window_size"),
    (["mode.name=mixgrpo", "mode.window_strategy=zigzag"], "mode.window_strategy"),
    (["mode.name=fast", "mode.window_size=6"], "mode.window_size"),
    (["mode.name=flow_grpo", "mode.train_fraction=0"], "mode.train_fraction"),
    (["mode.name=branch", "mode.split_points=[2,10]", "train.group_size=4"], "mode.split_points"),
    (["mode.name=branch", "mode.split_points=[3,1]", "train.group_size=4"], "mode.split_points"),
    (["mode.name=branch", "mode.split_points=[1,2]", "train.group_size=8"], "train.group_size"),
    (["mode.name=branch", "mode.split_points=[1,2]", "train.group_size=4", "mode.width_keep=0"],
     "mode.width_keep"),
    (["mode.name=branch", "mode.split_points=[1,2]", "train.group_size=4", "mode.depth_prune_window=9"],
     "mode.depth_prune_window"),
    (["mode.name=tempflow", "mode.tempflow_candidates=[12]"], "mode.tempflow_candidates"),
    (["mode.timestep_weighting=loud"], "mode.timestep_weighting"),
    (["model.path=/no/such/model"], "model.path"),
    (["sampling.latent_dtype=int8"], "sampling.latent_dtype"),
    (["model.guidance_scale_2=3.0"], "model.guidance_scale_2"),  # an SD3 preset: no low-noise expert
    (["model.train_experts=hi"], "model.train_experts"),
    (["mode.name=branch", "mode.split_points=[1,2]", "train.group_size=4", "reward_aggregation=gdpo"],
     "reward_aggregation"),  # the tree computes its own advantages
    (["mode.name=branch", "mode.split_points=[1,2]", "train.group_size=4", "grpo.adv_batch_norm=true"],
     "grpo.adv_batch_norm"),
    # per-depth z-scores of backed-up means, which tie only up to rounding: eps 0 made them +-1, and the tree's
    # advantages refused it only after the first rollout
    (["mode.name=branch", "mode.split_points=[1,2]", "train.group_size=4", "grpo.adv_eps=0"], "grpo.adv_eps"),
    # a tree row (leaf) holds the transitions of every node it is the first leaf of, so rows hold different unit
    # counts: a per-row mean would weigh a node's transition by how many its owner holds
    (["mode.name=branch", "mode.split_points=[1,2]", "train.group_size=4",
      "grpo.loss_aggregation=seq-mean-token-mean"], "grpo.loss_aggregation"),
    # a kernel without noise has no log-prob to train; CPS's sin(a*pi/2) turns negative past a = 2 (NaN log-probs)
    (["sampling.sde=flow_grpo", "sampling.noise_level=0"], "sampling.noise_level"),
    (["sampling.sde=cps", "sampling.noise_level=0"], "sampling.noise_level"),
    (["sampling.sde=cps", "sampling.noise_level=2.5"], "sampling.noise_level"),
    (["sampling.sde=dance", "sampling.eta=0"], "sampling.eta"),
])
def test_bad_mode_settings_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        config(*overrides)


@pytest.mark.parametrize("name", ["qwen2_vl", "sd9", "no.such.module:Adapter"])
def test_a_model_type_that_is_not_a_flow_adapter_fails_when_the_config_loads(name):
    """The VLM's qwen2_vl shares the MODEL_ADAPTERS registry; the flow config names only the flow types."""
    with pytest.raises(ConfigError) as err:
        config(f"model.type={name}")
    message = str(err.value)
    assert "'model.type'" in message and "\n" not in message
    if ":" not in name:
        assert "flow types: flux, sd3, wan" in message and "qwen2_vl" not in message.replace(f"'{name}'", "")


def test_the_noise_setting_a_kernel_does_not_use_may_be_zero():
    assert config("sampling.sde=dance", "sampling.noise_level=0").sampling.noise_level == 0
    assert config("sampling.sde=cps", "sampling.eta=0", "sampling.noise_level=1").sampling.eta == 0


def test_cps_takes_sampling_noise_level_and_dance_takes_eta():
    """Flow-GRPO's CPS std is sigma_prev*sin(noise_level*pi/2), the noise level its flow_grpo SDE uses too."""
    x = torch.zeros(1, 4)
    for sde, expected in (("cps", 0.6 * math.sin(0.5 * math.pi / 2)), ("dance", 0.2 * math.sqrt(0.2)),
                          ("flow_grpo", 0.5 * math.sqrt(0.8 / 0.2) * math.sqrt(0.2))):
        sampling = config(f"sampling.sde={sde}", "sampling.noise_level=0.5", "sampling.eta=0.2").sampling
        std = sde_kernel(sampling, 0.9)(x, x, 0.8, 0.6, noise=x).std
        assert float(std) == pytest.approx(expected, rel=1e-6), sde


@pytest.mark.parametrize("name", ["mixgrpo", "mixgrpo_flash", "branch"])
def test_a_window_longer_than_the_schedule_is_one_line_naming_both_keys(name):
    tree = ["mode.branch_variant=mix", "mode.split_points=[1,2]", "train.group_size=4"] if name == "branch" else []
    with pytest.raises(ConfigError) as err:
        config(f"mode.name={name}", "mode.window_size=11", *tree)
    message = str(err.value)
    assert "'mode.window_size'" in message and "'sampling.num_steps' = 10" in message and "\n" not in message
    whole = build_mode(config(f"mode.name={name}", "mode.window_size=10", *tree))  # the whole schedule fits
    if name == "branch":
        assert all(whole.sde)


def test_every_mode_is_registered():
    from mmgrpo.registry import ROLLOUT_MODES

    assert set(ROLLOUT_MODES.names()) >= {"flow_grpo", "dance_grpo", "fast", "mixgrpo", "mixgrpo_flash",
                                          "branch", "tempflow"}
    assert FlowConfig().mode.name in ROLLOUT_MODES


# ---------------------------------------------------------------- the tree rollout on the tiny model


@pytest.fixture(scope="module")
def branch_policy(one_thread):
    from mmgrpo.pipelines.flow.policy import FlowPolicy

    cfg = config("mode.name=branch", "mode.split_points=[1,2]", "mode.branch_factor=2", "train.group_size=4",
                 "train.micro_batch_size=8", "sampling.num_steps=4", "mode.width_keep=1.0",
                 "mode.depth_prune_window=0")
    return FlowPolicy(cfg)


@pytest.fixture(scope="module")
def branch_rollout(branch_policy):
    """A tree rollout of 2 prompts x 4 leaves, and the number of rows of every transformer call it made."""
    calls = []
    hook = branch_policy.adapter.transformer.register_forward_hook(
        lambda _m, _args, kwargs, _out: calls.append(kwargs["hidden_states"].shape[0]), with_kwargs=True)
    try:
        items = [{"prompt": "a red circle", "target_rgb": [255, 0, 0]},
                 {"prompt": "a blue cube", "target_rgb": [0, 0, 255]}]
        return branch_policy.rollout(items, [0, 1], 4), calls
    finally:
        hook.remove()


def test_tree_rollout_shares_prefixes_with_one_batched_forward_per_step(branch_rollout):
    rollout, calls = branch_rollout
    # splits at steps 1 and 2: 1, 1, 2, 4 input nodes per prompt at steps 0..3, one call per step for both
    # prompts, [cond; uncond] in one forward
    assert calls == [4, 4, 8, 16]
    assert rollout.counters["nfe/rollout"] == 2 * 16  # a CFG pair counts 2; 8 chains would take 2 * 8 * 4
    assert len(rollout) == 8 and rollout.reward_batch.images.shape == (8, 3, 32, 32)
    # units are steps 1..3 (the root's step 0 carries no advantage); one owner leaf per node
    assert rollout.mask.sum(dim=0).tolist() == [4, 8, 8] and rollout.recompute_old_logp


def test_branch_log_prob_uses_the_std_it_sampled_with(branch_policy, branch_rollout):
    rollout, _ = branch_rollout
    data, mask = rollout.data, rollout.mask
    rows = torch.arange(len(rollout))
    with torch.no_grad():
        fresh = branch_policy.log_probs(rollout, rows, None, with_kl=False).logp
    assert (fresh - rollout.old_logp).abs()[mask].max() < 1e-5
    # the drawn noise, standardised with the kernel's std, is standard normal (BranchGRPO's public code
    # samples children with 4x noise but scores them with the unscaled std)
    z = []
    for u in range(mask.shape[1]):
        own = rows[mask[:, u]]
        x, nxt = data["x"][own, u].float(), data["x_next"][own, u].float()
        sigma, sigma_next = data["sigma"][own, u], data["sigma_next"][own, u]
        with torch.no_grad():
            v = branch_policy._velocity(x, sigma, data["embeds"].select(own))
        out = branch_policy.kernel(x, v, sigma, sigma_next, prev_sample=nxt)
        z.append(((nxt - out.mean) / out.std.view(-1, 1, 1, 1)).flatten())
    z = torch.cat(z)
    assert abs(z.std().item() - 1) < 0.05 and abs(z.mean().item()) < 0.05


def test_branch_unit_advantages_are_clipped_to_adv_clip(branch_policy, branch_rollout, monkeypatch):
    """grpo.adv_clip bounds the tree's depth-wise advantages too: prompt 0's depth-1 z-scores -1 | +1 and leaf
    z-scores (-3.5, -1.5, 0.5, 4.5) / sqrt(35 / 4) become -0.5 | 0.5 and (-0.5, -0.5, 0.169, 0.5) at a clip of 0.5."""
    rollout, _ = branch_rollout
    rollout = dataclasses.replace(rollout, mask=rollout.mask.clone(), data=dict(rollout.data))
    monkeypatch.setattr(branch_policy.cfg.grpo, "adv_clip", 0.5)
    rewards = torch.tensor([1.0, 3.0, 5.0, 9.0, 0.0, 0.0, 2.0, 2.0])
    adv = branch_policy.unit_advantages(rollout, torch.zeros(8), rewards)
    torch.testing.assert_close(adv[:4, 0], torch.tensor([-0.5, -0.5, 0.5, 0.5]), atol=1e-4, rtol=0)
    leaf = torch.tensor([-0.5, -0.5, 0.5 / math.sqrt(35 / 4), 0.5])
    torch.testing.assert_close(adv[:4, 2], leaf, atol=1e-4, rtol=0)


def test_a_nan_leaf_reward_takes_its_prompts_mean_in_the_tree(branch_policy, branch_rollout):
    """A leaf reward that does not apply (NaN) backs up as the mean of its prompt's other leaves: prompt 0's leaves
    1, NaN, 5, 9 are 1, 5, 5, 9 (depth 1: 3 | 7, z-scores -1 | +1; leaves z = (-4, 0, 0, 4) / sqrt(8)); a prompt
    whose leaves are all NaN gets advantage 0 everywhere."""
    rollout, _ = branch_rollout
    rollout = dataclasses.replace(rollout, mask=rollout.mask.clone(), data=dict(rollout.data))
    rewards = torch.tensor([1.0, math.nan, 5.0, 9.0] + [math.nan] * 4)
    adv = branch_policy.unit_advantages(rollout, torch.zeros(8), rewards)
    torch.testing.assert_close(adv[:4, 0], torch.tensor([-1.0, -1.0, 1.0, 1.0]), atol=1e-4, rtol=0)
    torch.testing.assert_close(adv[:4, 2], torch.tensor([-1.0, 0.0, 0.0, 1.0]) * math.sqrt(2), atol=1e-4, rtol=0)
    assert adv[4:].abs().max() == 0


def test_branch_unit_advantages_are_depthwise_and_width_pruned(branch_policy, branch_rollout):
    rollout, _ = branch_rollout
    rollout = dataclasses.replace(rollout, mask=rollout.mask.clone(), data=dict(rollout.data))
    rollout.data["tree_plan"] = dataclasses.replace(rollout.data["tree_plan"], width_keep=0.5)
    rewards = torch.tensor([1.0, 3.0, 5.0, 9.0, 0.0, 0.0, 2.0, 2.0])
    adv = branch_policy.unit_advantages(rollout, torch.zeros(8), rewards)
    # unit 0 is depth 1: prompt 0's nodes have mean rewards 2 | 7, z-scores -1 | +1, owned by leaves 0 | 2
    assert adv[0, 0] == pytest.approx(-1, abs=1e-4) and adv[2, 0] == pytest.approx(1, abs=1e-4)
    assert adv[1, 0] == adv[0, 0]  # a leaf carries its ancestor's advantage even where it does not own it
    torch.testing.assert_close(adv[4:, 0], torch.tensor([-1.0, -1, 1, 1]), atol=1e-3, rtol=0)  # 0 | 2
    # leaf depth (units 1, 2): only the best and the worst leaf of each prompt stay trained
    assert rollout.mask[:4, 1].tolist() == [True, False, False, True]
    assert rollout.mask[:4, 0].tolist() == [True, False, True, False]
    # training packs steps into backward passes of at most one micro-batch (8) of owned transitions: 4 + 4 | 4
    chunks = branch_policy.unit_chunks(rollout)
    assert [c.tolist() for c in chunks] == [[0, 1], [2]]
    rows = torch.arange(8)
    with torch.no_grad():
        packed = branch_policy.log_probs(rollout, rows, chunks[0], with_kl=False).logp
        single = [branch_policy.log_probs(rollout, rows, torch.tensor([u]), with_kl=False).logp
                  for u in (0, 1)]
    mask = rollout.mask[:, :2]
    assert (packed - torch.cat(single, dim=1)).abs()[mask].max() < 1e-5 and packed[~mask].abs().max() == 0

"""FlowPolicy on the tiny SD3 (and Wan): on-policy exactness of every mode through the trainer, KL,
checkpoints, stock-diffusers loading, deterministic generation, video samples and bad input."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState
from random_flow import RANDOM_TINY_SD3

from mmgrpo.config import ConfigError, load_config
from mmgrpo.grpo.losses import aggregation_weights
from mmgrpo.pipelines.flow.data import prompt_datasets
from mmgrpo.pipelines.flow.modes import LinearPlan
from mmgrpo.pipelines.flow.policy import STATE_FILE, FlowPolicy
from mmgrpo.trainer import Trainer, make_accelerator

SMALL = ["sampling.num_steps=4", "sampling.eval_num_steps=3", "train.group_size=4",
         "train.micro_batch_size=2", "train.max_steps=1", "train.eval_every=0", "train.save_every=0",
         "logging.progress=false", "logging.plot_every=0"]
"""4 steps, one prompt x 4 samples in two micro-batches of 2 (the chunking must line up), CFG 4.5, LoRA r8."""

MODES = {  # flow_grpo and mixgrpo are also trained below (KL and checkpoint tests), and checked there
    "flow_grpo_bf16_latents": ("tiny_flowgrpo", ["sampling.latent_dtype=bfloat16"]),
    "flow_grpo_two_updates": ("tiny_flowgrpo", ["train.updates_per_rollout=2"]),
    "dance_grpo": ("tiny_dancegrpo", []),
    "dance_grpo_shared_noise": ("tiny_dancegrpo", ["mode.shared_initial_noise=true"]),  # the FLUX recipe's
    "mixgrpo_flash": ("tiny_mixgrpo_flash", ["mode.window_size=1"]),
    "fast": ("tiny_flowgrpo", ["mode.name=fast", "mode.window_size=2"]),
    "mixgrpo_shared_noise": ("tiny_mixgrpo", ["mode.shared_initial_noise=true"]),
    "branch": ("tiny_branchgrpo", ["mode.split_points=[0,2]", "mode.depth_prune_window=1"]),
    "branch_two_updates": ("tiny_branchgrpo", ["mode.split_points=[0,2]", "mode.depth_prune_window=1",
                                               "train.updates_per_rollout=2"]),
    "tempflow": ("tiny_tempflow", []),
    "tempflow_groups_share_a_chunk": ("tiny_tempflow", ["train.prompts_per_step=2", "train.group_size=2",
                                                        "train.micro_batch_size=4"]),
}
ITEMS = [{"prompt": "a red circle on a black background", "target_rgb": [255, 0, 0]},
         {"prompt": "a blue cube on a black background", "target_rgb": [0, 0, 255]}]


ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def at_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # preset prompt files are relative to the repository root
    monkeypatch.setattr("mmgrpo.trainer.plot_metrics", lambda *args: None)  # matplotlib: seconds per run


def config(preset, tmp_path, *overrides):
    path = ROOT / "configs" / "flow" / f"{preset}.yaml"
    return load_config(path, [*RANDOM_TINY_SD3, *SMALL, f"output_dir={tmp_path}", *overrides])


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One loaded LoRA adapter for the module and its initial trainable weights."""
    policy = FlowPolicy(config("tiny_flowgrpo", tmp_path_factory.mktemp("init")))
    named = policy.adapter.transformer.named_parameters()
    initial = {n: p.detach().clone() for n, p in named if p.requires_grad}
    return policy.adapter, initial


@pytest.fixture
def adapter(shared):
    """The shared adapter with its LoRA weights reset to their initial values (B = 0: the reference
    policy)."""
    adapter, initial = shared
    with torch.no_grad():
        for name, p in adapter.transformer.named_parameters():
            if name in initial:
                p.copy_(initial[name])
    return adapter


def train(cfg, adapter):
    policy = FlowPolicy(cfg, adapter=adapter)
    return policy, Trainer(cfg, policy=policy).train()


@pytest.mark.parametrize("case", list(MODES))
def test_first_ratio_is_exactly_one_for_every_mode(case, adapter, tmp_path):
    preset, overrides = MODES[case]
    cfg = config(preset, tmp_path, *overrides)
    _, rows = train(cfg, adapter)
    row = rows[0]
    assert row["ratio/onpolicy_max_dev"] <= 1e-6
    assert row["nfe/rollout"] > 0 and row["nfe/train"] > 0 and row["steps/trained"] > 0
    if case.startswith("branch"):  # sampled in tree layout, rescored in training chunking: same noise and std
        # the first update's old log-probs are its own forward's, so the ratio check above holds by construction:
        # this deviation is branch's exactness check (measured 1.2e-7)
        assert row["logp/rollout_vs_recompute_max_dev"] <= 1e-6
        # with one update its own forward gives the old log-probs; the second update's rows need a pass
        assert (row["nfe/recompute"] > 0) == (case == "branch_two_updates")
    else:
        assert "logp/rollout_vs_recompute_max_dev" not in row


REFILL_MODES = {  # the chain layouts (per-sample trained steps; a shared prefix with one unit) and a tree
    "dance_grpo": ("tiny_dancegrpo", []),
    "tempflow": ("tiny_tempflow", []),
    "branch_prob": ("tiny_branchgrpo", ["mode.split_points=[0,2]", "mode.depth_prune_window=1",
                                        "mode.reward_backup=prob"]),
}


@pytest.mark.parametrize("case", list(REFILL_MODES))
def test_refill_trains_on_groups_merged_from_several_rounds(case, adapter, tmp_path):
    """Dynamic sampling's refill: 2 prompts a step, signal in groups 1, 4, 7, ... Group 0 (no signal) is
    replaced by group 2 (none either), then by group 4: the trained rollout merges rows of rounds 0 and 2. Its
    stored transitions, embeddings and (trees) split log-probs must stay aligned: rescored in training chunking,
    they give the sampler's log-probs again."""
    preset, overrides = REFILL_MODES[case]
    cfg = config(preset, tmp_path, *overrides, "train.prompts_per_step=2", "grpo.mask_zero_std_groups=true",
                 "grpo.refill_rounds=2", 'rewards=[{name: "random_flow:every_third_group_brightness"}]')
    _, rows = train(cfg, adapter)
    row = rows[0]
    assert row["dynamic/rounds"] == 2 and row["dynamic/groups_sampled"] == 4 and row["dynamic/signal_frac"] == 1
    assert row["ratio/onpolicy_max_dev"] <= 1e-6
    assert row["logp/rollout_vs_recompute_max_dev"] <= 1e-5
    assert row["reward/std_within_group"] > 0


def test_a_refill_round_keeps_the_iteration_and_draws_its_own_noise(adapter, tmp_path):
    """MixGRPO's window moves every iteration here; a refill round samples in the window of its iteration."""
    cfg = config("tiny_mixgrpo", tmp_path, "mode.window_size=1", "mode.shift_interval=1",
                 "mode.window_strategy=progressive", "mode.shared_initial_noise=false")
    policy = FlowPolicy(cfg, adapter=adapter)
    first = policy.rollout(ITEMS, [0, 1], 4)
    again = policy.refill_rollout(ITEMS, [2, 3], 4, round_index=1)
    assert policy.rollouts == 1
    torch.testing.assert_close(again.data["sigma"], first.data["sigma"], rtol=0, atol=0)
    assert not torch.equal(again.data["x"], first.data["x"])
    moved = policy.rollout(ITEMS, [4, 5], 4)
    assert not torch.equal(moved.data["sigma"], first.data["sigma"])
    merged = policy.merge_groups([first, again], [torch.arange(4, 8), torch.arange(0, 4)])
    assert merged.group.tolist() == [1] * 4 + [2] * 4 and merged.recompute_old_logp
    torch.testing.assert_close(merged.data["x"], torch.cat([first.data["x"][4:], again.data["x"][:4]]))
    torch.testing.assert_close(merged.data["embeds"].cond["encoder_hidden_states"],
                               torch.cat([first.data["embeds"].cond["encoder_hidden_states"][4:],
                                          again.data["embeds"].cond["encoder_hidden_states"][:4]]))
    assert merged.counters["nfe/rollout"] == first.counters["nfe/rollout"] + again.counters["nfe/rollout"]


def test_dr_grpo_divides_by_the_same_unit_count_when_a_cps_window_reaches_the_last_step(adapter, tmp_path):
    """seq-mean-token-sum-norm divides a sample's unit sum by ``max_units``, a constant of the config: here the
    window of 2 covers steps 0-1, 1-2, then 2-3, where the deterministic last cps step leaves one trained step."""
    cfg = config("tiny_mixgrpo", tmp_path, "mode.shift_interval=1", "sampling.sde=cps", "sampling.noise_level=0.5",
                 "grpo.loss_aggregation=seq-mean-token-sum-norm")
    policy = FlowPolicy(cfg, adapter=adapter)
    widths = [policy.rollout(ITEMS[:1], [i], 4).mask.shape[1] for i in range(3)]
    assert widths == [2, 2, 1] and policy.max_units() == 2
    one_unit = torch.ones(4, 1, dtype=torch.bool)
    weights = aggregation_weights(one_unit, cfg.grpo.loss_aggregation, policy.max_units())
    assert weights.tolist() == [[1 / 8]] * 4  # not 1 / 4: the per-unit weight stays that of the first windows


def test_merging_tree_rollouts_keeps_each_kept_prompts_split_log_probs(adapter, tmp_path):
    cfg = config("tiny_branchgrpo", tmp_path, "mode.split_points=[0,2]", "mode.depth_prune_window=1",
                 "mode.reward_backup=prob")
    policy = FlowPolicy(cfg, adapter=adapter)
    first = policy.rollout(ITEMS, [0, 1], 4)
    again = policy.refill_rollout(ITEMS, [2, 3], 4, round_index=1)
    merged = policy.merge_groups([first, again], [torch.arange(4, 8), torch.arange(0, 8)])
    assert merged.group.tolist() == [1] * 4 + [2] * 4 + [3] * 4 and merged.data["tree_plan"] == first.data["tree_plan"]
    for k, split in enumerate(merged.data["split_logp"]):  # (prompts, nodes at the split's depth)
        torch.testing.assert_close(split, torch.cat([first.data["split_logp"][k][1:], again.data["split_logp"][k]]))
    torch.testing.assert_close(merged.mask, torch.cat([first.mask[4:], again.mask]))


def test_kl_is_zero_at_init_then_positive_and_counters_add_up(adapter, tmp_path):
    cfg = config("tiny_flowgrpo", tmp_path, "train.max_steps=2", "optim.lr=1e-2")
    _, rows = train(cfg, adapter)
    assert rows[0]["ratio/onpolicy_max_dev"] <= 1e-6
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-12)
    assert rows[1]["kl"] > 0
    # 4 samples x 4 steps x 2 (CFG); 3 trained steps x 4 samples x (policy cond + reference cond and uncond): the
    # policy's unconditional velocities come from the rollout, whose weights the single update still has
    assert rows[0]["nfe/rollout"] == 32 and rows[0]["nfe/train"] == 36 and rows[0]["nfe/train_grad"] == 12


def test_kl_is_the_mean_gap_over_flow_grpos_std_t(adapter, tmp_path):
    """The KL of a Flow-GRPO SDE step is mean(||mean - mean_ref||^2) / (2 std_t^2) with std_t = a*sqrt(sigma/(1-s))
    the noise scale per unit time (s = sigmas[1] at the first level), as Flow-GRPO trains (its KL betas are tuned to
    it): the means differ by (v - v_ref) * (1 + std_t^2 (1 - sigma) / (2 sigma)) * dt."""
    cfg = config("tiny_flowgrpo", tmp_path)
    policy = FlowPolicy(cfg, adapter=adapter)
    rollout = policy.rollout(ITEMS[:1], [0], cfg.train.group_size)
    lora = [p for n, p in policy.model.named_parameters() if "lora_B" in n]
    with torch.no_grad():
        saved = [p.clone() for p in lora]
        for p in lora:  # the policy moves away from the reference (LoRA B starts at 0)
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
        rollout.weights_updated = True  # the rollout's unconditional velocities are no longer the policy's
        try:
            rows, units = torch.arange(2), torch.tensor([0, 2])
            kl = policy.log_probs(rollout, rows, units, with_kl=True).kl
            d, (r, u) = rollout.data, torch.meshgrid(rows, units, indexing="ij")
            x, sigma, sigma_next = d["x"][r, u].flatten(0, 1), d["sigma"][r, u].flatten(), d["sigma_next"][r, u].flatten()
            embeds, g = d["embeds"].select(r.flatten()), cfg.sampling.guidance_scale
            gap = adapter.velocity(x, sigma, embeds, g) - adapter.reference_velocity(x, sigma, embeds, g)
        finally:
            for p, old in zip(lora, saved):
                p.copy_(old)
    sigmas, a = policy.sigmas, cfg.sampling.noise_level
    s = torch.minimum(sigma, sigmas[1])
    std_t = (a * (sigma / (1 - s)).sqrt()).view(-1, 1, 1, 1)
    sig, dt = sigma.view(-1, 1, 1, 1), (sigma_next - sigma).view(-1, 1, 1, 1)
    mean_gap = gap * (1 + std_t ** 2 * (1 - sig) / (2 * sig)) * dt
    expected = (mean_gap ** 2 / (2 * std_t ** 2)).flatten(1).mean(1).view(2, 2)
    assert float(expected.min()) > 0
    torch.testing.assert_close(kl, expected, rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("preset", ["tiny_flowgrpo", "tiny_dancegrpo", "tiny_branchgrpo", "tiny_tempflow"])
@pytest.mark.parametrize("updates", [1, 2])
def test_nfe_counters_are_the_rows_the_transformer_ran(preset, updates, adapter, tmp_path):
    """The first update reuses the rollout's unconditional forwards; with two updates the second one's rows run
    theirs again (the weights have moved). The tree (split at steps 0 and 2, 4 leaves, width pruning to 2)
    trains one-row micro-batches, so some (micro-batch, step chunk) pairs own no transition: a pruned leaf's
    last steps, or a shared node another leaf owns. Each still runs one placeholder forward."""
    tree = ["mode.split_points=[0,2]", "mode.depth_prune_window=1", "train.micro_batch_size=1"]
    cfg = config(preset, tmp_path, f"train.updates_per_rollout={updates}", f"train.max_steps={updates}",
                 *(tree if preset == "tiny_branchgrpo" else []))
    ran = []
    hook = adapter.transformer.register_forward_hook(
        lambda _m, _args, kwargs, _out: ran.append(kwargs["hidden_states"].shape[0]), with_kwargs=True)
    try:
        _, rows = train(cfg, adapter)
    finally:
        hook.remove()
    assert len(rows) == updates
    assert sum(ran) == rows[0]["nfe/rollout"] + rows[0]["nfe/train"]
    if preset == "tiny_flowgrpo":  # 4 samples x 4 steps x CFG; 12 trained steps x (2 + 2 for KL) - reused
        assert sum(ran) == 32 + 48 - 12 // updates


def test_checkpoint_round_trip_keeps_weights_and_window_position(adapter, tmp_path, monkeypatch, capsys):
    cfg = config("tiny_mixgrpo", tmp_path, "train.max_steps=2")
    _, rows = train(cfg, adapter)
    assert max(r["ratio/onpolicy_max_dev"] for r in rows) <= 1e-6
    saved = tmp_path / "checkpoints" / "step-2" / "policy"
    assert (saved / "pytorch_lora_weights.safetensors").is_file()
    assert json.loads((saved / STATE_FILE).read_text()) == {"rollouts": 2}
    trained = {n: p.detach().clone() for n, p in adapter.transformer.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for p in adapter.transformer.parameters():
            if p.requires_grad:
                p.add_(1.0)
    fresh = FlowPolicy(cfg, adapter=adapter)
    fresh.load(saved)
    assert fresh.rollouts == 2
    for name, p in adapter.transformer.named_parameters():
        if name in trained:
            torch.testing.assert_close(p, trained[name], rtol=0, atol=0)

    from mmgrpo.cli import main

    monkeypatch.setattr("mmgrpo.policy.build_policy", lambda c: FlowPolicy(c, adapter=adapter))
    preset = str(ROOT / "configs" / "flow" / "tiny_mixgrpo.yaml")
    args = ["sample", preset, *RANDOM_TINY_SD3, *SMALL, f"output_dir={tmp_path}", "resume=latest", "--prompt", "a red circle",
            "--prompt", "a green cube"]
    assert main(args) == 0
    tag = f"sample-{saved.parent.name}"  # the grid, and the folder of each sample and its index
    assert sorted(p.name for p in (tmp_path / "samples").glob("sample-*")) == [tag, f"{tag}.png"]
    capsys.readouterr()
    # eval follows the given config, says where it differs from the training one, and keeps each result
    evaluate = ["eval", preset, *RANDOM_TINY_SD3, *SMALL, f"output_dir={tmp_path}", "resume=latest",
                "data.num_eval=2"]
    assert main([*evaluate, "sampling.guidance_scale=2.0"]) == 0
    note = capsys.readouterr().err
    assert "differs from the one" in note and "sampling.guidance_scale" in note
    result = json.loads((tmp_path / "eval.json").read_text())
    assert "sampling.guidance_scale" in result["config_changes"]
    assert json.loads((tmp_path / "samples" / "eval-step-2.json").read_text()) == result
    assert main(evaluate) == 0  # a second evaluation keeps the first one's file
    assert json.loads((tmp_path / "samples" / "eval-step-2-2.json").read_text())["config_changes"] == [
        k for k in result["config_changes"] if k != "sampling.guidance_scale"]
    capsys.readouterr()
    # a model setting the saved weights do not fit is named, not blamed on the checkpoint's files
    monkeypatch.undo()  # the policy builds its own adapter, of rank 4
    assert main([*evaluate, "model.lora_rank=4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the loading bars
    assert err.startswith("config error: bad value for 'model.lora_rank': 4, but checkpoint")


def test_shared_initial_noise_starts_each_group_from_one_latent(adapter, tmp_path):
    """With the window on the first steps, the first trained step's input is the initial latent."""
    for shared in (True, False):
        cfg = config("tiny_mixgrpo", tmp_path, "mode.window_size=2", "mode.shift_interval=1000",
                     f"mode.shared_initial_noise={str(shared).lower()}")
        policy = FlowPolicy(cfg, adapter=adapter)
        rollout = policy.rollout(ITEMS, [0, 1], group_size=4)
        first = rollout.data["x"][:, 0].float().view(2, 4, -1)
        same_in_group = bool((first == first[:, :1]).all())
        assert same_in_group == shared
        assert not torch.equal(first[0, 0], first[1, 0])  # groups differ either way
        assert not torch.equal(rollout.data["x_next"][0, 0], rollout.data["x_next"][1, 0])  # own SDE noise


@pytest.mark.parametrize(("group_size", "micro_batch", "ks", "rows_run"), [
    # rows per step 0..3: the group leaders 0, 4 | B's chunks (4) + A's leader | A's chunks (4) + B's rows | 8
    (4, 2, [2, 1], 2 + 5 + 8 + 8),
    # one chunk of both groups: leaders 0, 2 | the chunk, where A trains | the chunk, where B trains | 4
    (2, 4, [1, 2], 2 + 4 + 4 + 4),
])
def test_tempflow_runs_each_groups_ode_prefix_once(group_size, micro_batch, ks, rows_run, adapter, tmp_path):
    """Members share the start noise and run ODE up to their branch step k: the steps before k run on one row
    per group, and k runs whole micro-batch chunks (training's layout) even where other groups still share.
    The samples are the unshared computation's up to the float noise of running rows in batches of another
    size (the unshared samples move by up to 2.6e-6 in micro-batches of 1 instead; their log-probs by 1.2e-7)."""
    cfg = config("tiny_tempflow", tmp_path, f"train.group_size={group_size}",
                 f"train.micro_batch_size={micro_batch}")
    policy = FlowPolicy(cfg, adapter=adapter)
    embeds = adapter.encode([it["prompt"] for it in ITEMS], "", cfg.sampling.guidance_scale)
    steps = torch.tensor(ks).repeat_interleave(group_size)[:, None]
    plan = LinearPlan(torch.zeros(len(steps), 4, dtype=torch.bool).scatter_(1, steps, True), steps,
                      shared_noise=True)
    ran = []
    hook = adapter.transformer.register_forward_hook(
        lambda _m, _args, kwargs, _out: ran.append(kwargs["hidden_states"].shape[0]), with_kwargs=True)
    try:
        runs = {share: policy._sample_chain(dataclasses.replace(plan, share_prefix=share), embeds, group_size,
                                            torch.Generator().manual_seed(1)) for share in (True, False)}
    finally:
        hook.remove()
    (x, data, nfe), (x_all, data_all, nfe_all) = runs[True], runs[False]
    assert (nfe, nfe_all) == (rows_run, 4 * len(steps)) and sum(ran) == 2 * (nfe + nfe_all)  # CFG: 2 per row
    for key, tolerance in {"x": 1e-5, "x_next": 1e-5, "logp": 1e-6, "std": 0}.items():
        torch.testing.assert_close(data[key], data_all[key], rtol=0, atol=tolerance)
    torch.testing.assert_close(x, x_all, rtol=0, atol=1e-5)
    branch_input = data["x"][:, 0].view(len(ks), group_size, -1)
    assert bool((branch_input == branch_input[:, :1]).all())  # the members are one sample until k
    assert bool((data["x_next"][:, 0] != data["x_next"][:1, 0]).any())  # and differ by their noise at k


def test_tempflow_nfe_counts_the_shared_prefix_once(adapter, tmp_path):
    cfg = config("tiny_tempflow", tmp_path, "mode.tempflow_candidates=[2]")
    rollout = FlowPolicy(cfg, adapter=adapter).rollout(ITEMS, [0, 1], group_size=4)
    assert rollout.counters["nfe/rollout"] == 2 * (2 * 2 + 8 * 2)  # CFG x (2 leaders x 2 steps + 8 rows x 2)


def test_generate_is_deterministic_per_item(adapter, tmp_path):
    policy = FlowPolicy(config("tiny_flowgrpo", tmp_path), adapter=adapter)
    a = policy.generate(ITEMS)
    b = policy.generate(ITEMS)
    assert a.images.shape == (2, 3, 32, 32) and a.meta[0]["target_rgb"] == [255, 0, 0]
    torch.testing.assert_close(a.images, b.images, rtol=0, atol=0)
    alone = policy.generate(ITEMS[1:])
    torch.testing.assert_close(alone.images[0], a.images[1], rtol=0, atol=1e-4)  # its own seed, any batch
    assert (a.images[0] - a.images[1]).abs().max() > 0.01


def test_generate_is_the_stock_pipeline_at_the_eval_steps_and_guidance(adapter, tmp_path):
    """Evaluation samples (eval, sample, the demo's before and after) are the stock pipeline's images for the
    sample's seed, at sampling.eval_num_steps (3 here, 4 in training) and the run's guidance and negative prompt."""
    cfg = config("tiny_flowgrpo", tmp_path, "sampling.negative_prompt=blurry")
    out = FlowPolicy(cfg, adapter=adapter).generate(ITEMS[:1])
    s = cfg.sampling
    assert s.eval_num_steps != s.num_steps and s.guidance_scale > 1
    stock = adapter.pipe(prompt=ITEMS[0]["prompt"], negative_prompt=s.negative_prompt, height=s.height,
                         width=s.width, num_inference_steps=s.eval_num_steps, guidance_scale=s.guidance_scale,
                         max_sequence_length=adapter.max_sequence_length, output_type="pt", return_dict=False,
                         generator=torch.Generator().manual_seed(out.meta[0]["seed"]))[0]
    torch.testing.assert_close(out.images, stock, rtol=1e-4, atol=1e-4)


def test_generate_per_prompt_draws_k_seeded_samples_that_regenerate_alone(adapter, tmp_path):
    """``mmgrpo sample --per-prompt K``: K samples per item, grouped, each from its own noise seed; sample 0 is the
    one-per-item sample, and a sample's recorded seed, given as an item's ``seed``, regenerates it alone."""
    policy = FlowPolicy(config("tiny_flowgrpo", tmp_path), adapter=adapter)
    one = policy.generate(ITEMS)
    many = policy.generate(ITEMS, per_prompt=3)
    assert many.images.shape == (6, 3, 32, 32) and many.group.tolist() == [0, 0, 0, 1, 1, 1]
    assert many.prompts == [ITEMS[0]["prompt"]] * 3 + [ITEMS[1]["prompt"]] * 3
    seeds = [m["seed"] for m in many.meta]
    assert seeds[::3] == [m["seed"] for m in one.meta] and len(set(seeds)) == 6
    torch.testing.assert_close(many.images[::3], one.images, rtol=0, atol=1e-4)
    assert min((many.images[i] - many.images[j]).abs().max() for i, j in ((0, 1), (0, 2), (1, 2))) > 0.01
    torch.testing.assert_close(policy.generate(ITEMS, per_prompt=3).images, many.images, rtol=0, atol=0)
    assert [m["seed"] for m in policy.generate(ITEMS[1:], per_prompt=2).meta] == seeds[3:5]  # not K's or the batch's
    alone = policy.generate([{**ITEMS[1], "seed": seeds[5]}])
    assert alone.meta[0]["seed"] == seeds[5]
    torch.testing.assert_close(alone.images[0], many.images[5], rtol=0, atol=1e-4)


def test_lora_checkpoint_loads_into_a_stock_diffusers_pipeline(adapter, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    from mmgrpo.pipelines.flow.tiny import tiny_path

    policy = FlowPolicy(config("tiny_flowgrpo", tmp_path), adapter=adapter)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in adapter.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    policy.save(tmp_path / "lora")
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_path("sd3"))
    pipe.load_lora_weights(tmp_path / "lora")
    embeds = adapter.encode(["a red circle"], "", 1.0)
    x = torch.randn(1, 16, 4, 4)
    sigma = torch.tensor([0.7])
    with torch.no_grad():
        ours = adapter.velocity(x, sigma, embeds, 1.0)
        stock = adapter.velocity(x, sigma, embeds, 1.0, transformer=pipe.transformer)
        base = adapter.reference_velocity(x, sigma, embeds, 1.0)
    torch.testing.assert_close(stock, ours, rtol=0, atol=1e-5)
    assert (ours - base).abs().max() > 1e-3  # the LoRA changes the output, and the stock pipeline has it


def test_full_finetune_trains_exactly_and_saves_a_transformer_folder(tmp_path):
    from diffusers import SD3Transformer2DModel

    cfg = config("tiny_flowgrpo", tmp_path, "model.lora_rank=0", "optim.lr=1e-5")
    policy = FlowPolicy(cfg)
    rows = Trainer(cfg, policy=policy).train()
    assert rows[0]["ratio/onpolicy_max_dev"] <= 1e-6 and rows[0]["kl"] == pytest.approx(0.0, abs=1e-12)
    folder = tmp_path / "checkpoints" / "step-1" / "policy" / "transformer"
    loaded = SD3Transformer2DModel.from_pretrained(folder)
    mine = policy.unwrapped_model().state_dict()
    assert set(loaded.state_dict()) == set(mine)
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, mine[name], rtol=0, atol=0)


def test_wan_rollout_gives_videos_to_rewards_and_writes_an_mp4(tmp_path):
    cfg = config("tiny_flowgrpo", tmp_path, "model.type=wan", "model.path=tiny:wan", "sampling.num_frames=5",
                 "sampling.num_steps=2", "train.group_size=2", "grpo.kl_beta=0")
    policy = FlowPolicy(cfg)
    rollout = policy.rollout(ITEMS[:1], [0], 2)
    videos = rollout.reward_batch.videos
    assert videos.shape == (2, 5, 3, 32, 32) and rollout.reward_batch.images is None
    assert 0 <= videos.min() and videos.max() <= 1
    files = policy.save_samples(rollout.reward_batch, tmp_path / "samples", "wan")
    assert [f.suffix for f in files] == [".png", ".mp4"] and all(f.stat().st_size > 0 for f in files)


def test_a_sequence_length_beyond_the_text_encoder_is_a_config_error(tmp_path):
    """The stock SD3/FLUX pipelines refuse more than 512 T5 tokens; the tiny tokenizer takes 32."""
    with pytest.raises(ConfigError, match=r"^bad value for 'model.max_sequence_length': 33 \(this model's text "
                                          r"encoder takes at most 32 tokens\)$"):
        FlowPolicy(config("tiny_flowgrpo", tmp_path, "model.max_sequence_length=33"))


@pytest.mark.parametrize(("content", "message"), [
    (b"", "holds no prompts"),
    (b"\n  \n", "holds no prompts"),
    (b"\xff\xfe\x00binary", "not UTF-8"),
    (b'{"prompt": "ok"}\n  {"prompt": "unterminated\n', r":2: malformed JSON at column 14: Unterminated string starting at$"),
    (b'{"text": "no prompt key"}\n', "non-empty 'prompt'"),
])
def test_bad_prompt_files_name_the_key_and_file(tmp_path, content, message):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message) as err:
        prompt_datasets(str(path), None, 4)
    assert "'data.train_prompts'" in str(err.value) and str(path) in str(err.value)


def test_evaluating_on_training_prompts_is_warned(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("a red ball\na blue ball\n")
    with pytest.warns(UserWarning, match=r"data.eval_prompts is not set: evaluation uses the first 1 training prompts"):
        _, held_out = prompt_datasets(str(path), None, 1)
    assert held_out == [{"prompt": "a red ball"}]


def test_a_json_or_upper_case_jsonl_file_is_not_read_as_one_prompt_a_line(tmp_path):
    upper = tmp_path / "P.JSONL"
    upper.write_text('{"prompt": "a red ball", "target_rgb": [255, 0, 0]}\n')
    assert prompt_datasets(str(upper), None, 1)[0] == [{"prompt": "a red ball", "target_rgb": [255, 0, 0]}]
    array = tmp_path / "p.json"
    array.write_text('[\n  "a red ball",\n  "a blue ball"\n]\n')  # its lines are not prompts
    with pytest.raises(ConfigError, match=r"^bad value for 'data.train_prompts': .*p\.json .*\.jsonl.*\.txt"):
        prompt_datasets(str(array), None, 1)


@pytest.mark.parametrize("seed", ['"7"', "-1", "1.5", "null", "true"])
def test_an_item_seed_that_is_not_a_non_negative_integer_names_the_line(tmp_path, seed):
    """``seed`` picks an item's evaluation noise (FlowPolicy.generate)."""
    path = tmp_path / "p.jsonl"
    path.write_text(f'{{"prompt": "a red ball", "seed": 3}}\n{{"prompt": "a blue ball", "seed": {seed}}}\n')
    with pytest.raises(ConfigError, match=r"p\.jsonl:2: 'seed' must be an integer >= 0"):
        prompt_datasets(str(path), None, 1)


def test_prompt_sources(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("a red ball\n\n  # a comment\n  a blue ball \n")
    train, held_out = prompt_datasets(str(txt), None, 1)
    assert train == [{"prompt": "a red ball"}, {"prompt": "a blue ball"}] and held_out == train[:1]
    txt.write_text("\ufeffa red ball\r\na blue ball\r\n", newline="")  # a BOM and CRLF, as Windows editors save
    assert prompt_datasets(str(txt), None, 1)[0] == [{"prompt": "a red ball"}, {"prompt": "a blue ball"}]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('\ufeff{"prompt": "a red\u2028ball"}\n', encoding="utf-8")
    assert prompt_datasets(str(jsonl), None, 1)[0] == [{"prompt": "a red\u2028ball"}]
    with pytest.raises(ConfigError, match="'data.eval_prompts'.*not found"):
        prompt_datasets(str(txt), str(tmp_path / "missing.txt"), 4)
    with pytest.raises(ConfigError, match=r"^bad value for 'data.train_prompts': unknown task 'no_such_task' "
                                          r"\(known: [^()]*shapes_t2i[^()]*\)$"):
        prompt_datasets("task:no_such_task", None, 4)
    with pytest.raises(ConfigError, match="task 'shapes_qa' has no text prompts .*not a text-to-image task"):
        prompt_datasets("task:shapes_qa", None, 4)
    train, held_out = prompt_datasets("task:shapes_t2i", None, 3)
    assert train[0]["prompt"] and len(held_out) == 3 and not {i["prompt"] for i in held_out} & {
        i["prompt"] for i in train}


@pytest.mark.parametrize("size", ["sampling.height=24", "sampling.width=40"])
def test_an_image_size_the_model_cannot_patch_fails_when_the_policy_is_built(size, adapter, tmp_path):
    """The tiny SD3 (8x VAE, patch 2) needs multiples of 16 px: found before any rollout or evaluation."""
    with pytest.raises(ConfigError, match=rf"^bad value for '{size.split('=')[0]}': .*multiple of 16"):
        FlowPolicy(config("tiny_flowgrpo", tmp_path, size), adapter=adapter)


def test_unknown_model_type_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="'model.type'"):
        FlowPolicy(config("tiny_flowgrpo", tmp_path, "model.type=sd9"))


@pytest.mark.parametrize(("content", "message"), [(b"", "holds no prompts"), (b"\xff\xfe", "not UTF-8")])
def test_a_bad_prompt_file_fails_before_the_model_loads(tmp_path, content, message):
    """The prompts are read first: with a model that cannot load, the prompt file's error is the one raised."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(content)
    cfg = config("tiny_flowgrpo", tmp_path, "model.path=nobody/no-such-model", f"data.train_prompts={prompts}")
    with pytest.raises(ConfigError, match=f"'data.train_prompts'.*{message}"):
        FlowPolicy(cfg)


def test_noise_aware_weight_of_a_step_is_the_same_in_any_batch(adapter, tmp_path):
    """TempFlow's noise-aware weight of step k is std_k*sqrt|dt_k| over its mean over the schedule's steps: not 1
    in a one-group rollout, the same with more groups and in another mode, and larger for a noisier step."""
    a = 0.7  # sampling.noise_level of the preset; std_t = a*sqrt(sigma/(1-s)), s = sigmas[1] at sigmas[0]
    def weights(preset, *overrides, items=ITEMS[:1]):
        cfg = config(preset, tmp_path, "mode.timestep_weighting=noise_aware", *overrides)
        policy = FlowPolicy(cfg, adapter=adapter)
        rollout = policy.rollout(items, list(range(len(items))), cfg.train.group_size)
        return policy.sigmas, rollout.unit_weight, rollout.mask

    sigmas, _, _ = weights("tiny_tempflow")
    sigma, s = sigmas[:-1], sigmas[:-1].clone()
    s[0] = sigmas[1]
    noise = a * (sigma / (1 - s)).sqrt() * (sigma - sigmas[1:]).sqrt()
    expected = noise / noise.mean()
    assert float(expected[0]) > float(expected[2])
    for k in (0, 2):
        one = weights("tiny_tempflow", f"mode.tempflow_candidates=[{k}]")
        two = weights("tiny_tempflow", f"mode.tempflow_candidates=[{k}]", "train.prompts_per_step=2", items=ITEMS)
        for _, weight, mask in (one, two):
            torch.testing.assert_close(weight[mask], expected[k].expand(int(mask.sum())).to(weight))
    _, weight, mask = weights("tiny_flowgrpo")  # every step trained: unit u is step u
    assert bool(mask.all())
    torch.testing.assert_close(weight, expected[:weight.shape[1]].expand_as(weight).to(weight))


def test_two_processes_train_a_tree_in_sync(train_on_two_processes):
    """BranchGRPO (tree rollouts, old log-probs recomputed in training chunking) on the tiny SD3 under two gloo DDP
    processes: one prompt group per process, exactly on-policy, and identical LoRA weights afterwards."""
    report = train_on_two_processes(ROOT / "configs" / "flow" / "tiny_branchgrpo.yaml", *RANDOM_TINY_SD3,
                                    "sampling.num_steps=4", "mode.split_points=[0,2]", "mode.depth_prune_window=1",
                                    "train.group_size=4", "train.micro_batch_size=2", "train.prompts_per_step=2",
                                    "train.max_steps=2", "optim.lr=1e-2")
    assert report["num_processes"] == 2 and report["onpolicy_max_dev"] <= 1e-6
    assert report["param_rank_diff"] == 0.0 and report["param_change"] > 0


def test_sharded_rollouts_run_the_same_forwards_on_every_process(launch_two_processes):
    """tests/support/flow_fsdp_rollout_check.py: the tiny SD3 transformer sharded with FSDP2 over two processes,
    each rolling out its own prompt with its own noise. DanceGRPO's random trained steps and TempFlow's branch
    step then differ between the processes; with micro-batches smaller than a group, which chunks replay (two CFG
    forwards instead of one fused) and how many rows TempFlow's shared prefix runs used to differ too, and the
    processes' all-gathers no longer paired up."""
    report = launch_two_processes("flow_fsdp_rollout_check.py")
    assert report["sharded"]
    for preset in ("tiny_dancegrpo", "tiny_tempflow"):
        first, second = report[preset]["forwards"]
        assert first == second and min(first) > 0 and report[preset]["finite"], (preset, first, second)


@pytest.fixture
def own_accelerator_state():
    """Accelerate keeps one process-wide state whose mixed precision cannot change once set: cleared before and after
    a test that sets its own."""
    AcceleratorState._reset_state()
    yield
    AcceleratorState._reset_state()


def precision_trainer(tmp_path, dtype, mixed_precision):
    """A trainer of the tiny SD3 with ``model.dtype=dtype`` under accelerate's ``mixed_precision`` autocast. On CPU
    accelerate leaves fp16 autocast off; it is turned on here (with torch's CPU loss scaler), as a GPU run has it."""
    cfg = config("tiny_flowgrpo", tmp_path, f"model.dtype={dtype}", f"train.mixed_precision={mixed_precision}")
    acc = make_accelerator(cfg)
    if mixed_precision == "fp16":
        acc.native_amp, acc.scaler = True, torch.amp.GradScaler("cpu")
    return Trainer(cfg, policy=FlowPolicy(cfg), accelerator=acc)


@pytest.mark.usefixtures("own_accelerator_state")
@pytest.mark.parametrize("dtype, mixed_precision", [("float32", "bf16"), ("float32", "fp16"), ("bfloat16", "bf16"),
                                                    ("float16", "fp16")])
def test_first_ratio_is_exactly_one_under_mixed_precision(dtype, mixed_precision, tmp_path):
    """The stored unconditional velocities (model dtype: the transformer's output dtype here, or fp32 weights')
    are bitwise the first update's."""
    rows = precision_trainer(tmp_path, dtype, mixed_precision).train()
    assert rows[0]["ratio/onpolicy_max_dev"] <= 1e-6 and rows[0]["nfe/train"] > 0


@pytest.mark.usefixtures("own_accelerator_state")
@pytest.mark.parametrize("dtype, mixed_precision", [("float16", "bf16"), ("bfloat16", "fp16")])
def test_half_weights_under_the_other_half_precision_autocast_are_refused_at_start_up(dtype, mixed_precision,
                                                                                       tmp_path):
    """torch's autocast rejects float16 and bfloat16 inputs mixed in one op (a torch.cat of text embeddings, the
    transformer's own ops), so these runs failed in the first rollout ('Unexpected floating ScalarType'; on CPU
    a mixed-dtype layer_norm first)."""
    message = rf"^bad value for 'model.dtype': {dtype} cannot run under {mixed_precision} mixed precision \("
    with pytest.raises(ConfigError, match=message):
        precision_trainer(tmp_path, dtype, mixed_precision)

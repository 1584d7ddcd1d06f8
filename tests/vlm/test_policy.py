"""VLMPolicy on the tiny real-format Qwen2-VL: on-policy exactness, KL, bad media, prompt budget, truncation masks,
and checkpoints that load with transformers / PEFT."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from random_vlm import DATA, RANDOM_TINY_VLM

from mmgrpo.config import ConfigError, RewardSpec, load_config
from mmgrpo.grpo import ppo_clip_loss
from mmgrpo.pipelines.vlm.data import read_samples
from mmgrpo.pipelines.vlm.model import VISION_MODULES, VLMModel, module_names
from mmgrpo.pipelines.vlm.policy import BadItem, VLMPolicy, prepared_tensors
from mmgrpo.pipelines.vlm.prompt_cache import PromptCache
from mmgrpo.pipelines.vlm.video import decode_video, load_image
from mmgrpo.rewards import RewardZoo
from mmgrpo.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["data.prompt_template='{question}{options}'", "generation.max_new_tokens=6", "train.group_size=3",
         "train.micro_batch_size=2", "train.prompts_per_step=2", "generation.mask_truncated=true",
         "logging.progress=false"]


pytestmark = pytest.mark.usefixtures("one_thread")


def config(tmp_path: Path, preset: str = "tiny_image", overrides: tuple[str, ...] = (), varied: bool = False):
    """A tiny preset with short prompts and completions; ``varied`` swaps the format reward (0 for a random model)
    for a length reward, so rewards differ within groups and updates move the weights."""
    cfg = load_config(ROOT / "configs" / "vlm" / f"{preset}.yaml",
                      [*RANDOM_TINY_VLM, f"output_dir={tmp_path / 'run'}", *SHORT, *overrides])
    if varied:
        cfg.rewards[0] = RewardSpec(name="length", args={"min_len": 40, "max_len": 80})
    return cfg


def rollout_of(policy: VLMPolicy, items: list[dict]):
    with torch.no_grad():
        return policy.rollout(items, list(range(len(items))), policy.cfg.train.group_size)


def relogp(policy: VLMPolicy, rollout, with_kl: bool = False):
    """Log-probs (and KL) of every row in the training chunking, as the trainer's first inner epoch does."""
    logp, kl = [], []
    for rows in torch.arange(len(rollout)).split(policy.cfg.train.micro_batch_size):
        out = policy.log_probs(rollout, rows, None, with_kl)
        logp.append(out.logp.detach())
        kl.append(None if out.kl is None else out.kl.detach())
    return torch.cat(logp), None if kl[0] is None else torch.cat(kl)


@pytest.fixture(scope="module")
def lora_policy(tmp_path_factory):
    policy = VLMPolicy(config(tmp_path_factory.mktemp("lora")))
    policy.datasets()
    return policy


@pytest.mark.parametrize("prefix_grouper", [True, False])
def test_rollout_carries_the_samplers_logprobs_and_asks_the_trainer_for_the_forwards(lora_policy, prefix_grouper):
    """The rollout's log-probs are the sampler's (KV-cache decoding); the trainer replaces them by the training
    forward's (``recompute_old_logp``: the first ratio exactly 1, tested in test_presets.py), from which they differ
    by float rounding only."""
    policy = lora_policy
    policy.cfg.prefix_grouper = prefix_grouper
    try:
        rollout = rollout_of(policy, policy.train_items[:2])
        n = 2 * policy.cfg.train.group_size
        real = rollout.data["mask"]  # every sampled token, trained or not
        assert rollout.old_logp.shape[0] == n and real.sum() > n and rollout.recompute_old_logp
        logp, _ = relogp(policy, rollout)
        assert (logp - rollout.old_logp)[real].abs().max() < 1e-5
        assert (rollout.old_logp[real] < 0).all() and (rollout.old_logp[~real] == 0).all()
        assert rollout.counters["tokens/train"] > 0 and rollout.counters["tokens/vision"] > 0
    finally:
        policy.cfg.prefix_grouper = True


def test_vision_tokens_count_the_patch_embeddings_of_each_prompt(lora_policy):
    """``tokens/vision`` is the prompts' image and video tokens (one per merged patch: the grid's t*h*w over
    merge**2), not the vision start and end markers around them."""
    rollout = rollout_of(lora_policy, lora_policy.train_items[:2])
    merge = lora_policy.vlm.processor.image_processor.merge_size ** 2
    counts = [sum(int(p[k].prod(-1).sum()) // merge for k in ("image_grid_thw", "video_grid_thw") if k in p)
              for p in rollout.data["prompts"]]
    assert min(counts) > 0
    assert rollout.counters["tokens/vision"] == sum(counts) / len(counts)


@pytest.mark.parametrize("prefix_grouper", [True, False])
def test_logprobs_are_those_of_the_sampling_temperature(lora_policy, prefix_grouper, monkeypatch):
    """At generation.temperature 0.6 the trainer's log-probs equal the sampler's (logits / 0.6), not the
    temperature-1 ones, so the ratio and KL are of the distribution actually sampled from."""
    policy = lora_policy
    monkeypatch.setattr(policy.cfg, "prefix_grouper", prefix_grouper)
    monkeypatch.setattr(policy.cfg, "generation", replace(policy.cfg.generation, temperature=0.6))
    rollout = rollout_of(policy, policy.train_items[:2])
    real = rollout.data["mask"]
    at_sampling = rollout.old_logp  # the sampler's
    trained, _ = relogp(policy, rollout)
    assert (trained - at_sampling)[real].abs().max() < 1e-4
    monkeypatch.setattr(policy.cfg, "generation", replace(policy.cfg.generation, temperature=1.0))
    at_one, _ = relogp(policy, rollout)
    assert (at_one - at_sampling)[real].abs().max() > 1e-2


def test_prefix_grouper_matches_the_standard_forward(lora_policy):
    policy = lora_policy
    rollout = rollout_of(policy, policy.train_items[2:4])
    packed, _ = relogp(policy, rollout)
    policy.cfg.prefix_grouper = False
    try:
        standard, _ = relogp(policy, rollout)
    finally:
        policy.cfg.prefix_grouper = True
    assert torch.allclose(packed, standard, atol=1e-4)


def test_kl_is_zero_at_init_and_positive_after_an_update_with_lora(lora_policy):
    policy = lora_policy
    rollout = rollout_of(policy, policy.train_items[:2])
    real = rollout.data["mask"]
    _, kl = relogp(policy, rollout, with_kl=True)
    assert torch.equal(kl[real], torch.zeros_like(kl[real]))
    lora = [p for n, p in policy.model.named_parameters() if "lora_" in n]
    saved = [p.detach().clone() for p in lora]
    optimizer = torch.optim.SGD([p for p in policy.model.parameters() if p.requires_grad], lr=0.5)
    advantages = torch.linspace(-1, 1, len(rollout))[:, None].expand_as(rollout.old_logp)
    out = policy.log_probs(rollout, torch.arange(len(rollout)), None, with_kl=False)
    loss, _, _ = ppo_clip_loss(out.logp, rollout.old_logp, advantages, real, 0.2, 0.2, "token")
    loss.sum().backward()
    optimizer.step()
    try:
        logp, kl = relogp(policy, rollout, with_kl=True)
        assert (kl[real] >= 0).all() and kl[real].max() > 0
        assert not torch.equal(logp[real], rollout.old_logp[real])
    finally:
        with torch.no_grad():
            for p, s in zip(lora, saved):
                p.copy_(s)


def test_entropy_is_computed_only_when_asked_and_follows_the_units(lora_policy):
    """The trainer's training forward asks for the entropy; its no-grad recompute of old log-probs does not."""
    policy = lora_policy
    rollout = rollout_of(policy, policy.train_items[:2])
    rows, units = torch.arange(len(rollout)), torch.tensor([0, 2])
    with torch.no_grad():
        plain = policy.log_probs(rollout, rows, None, with_kl=False)
        full = policy.log_probs(rollout, rows, None, with_kl=False, with_entropy=True)
        part = policy.log_probs(rollout, rows, units, with_kl=False, with_entropy=True)
    assert plain.entropy is None
    real = rollout.data["mask"]
    assert torch.equal(plain.logp, full.logp)
    assert (full.entropy[real] > 0).all() and (full.entropy[~real] == 0).all()
    assert torch.equal(part.entropy, full.entropy[:, units]) and torch.equal(part.logp, full.logp[:, units])


def test_merged_groups_keep_their_tokens_logprobs_and_meta(lora_policy):
    """Dynamic sampling's refill merges groups of several rollouts (different prompts, completion widths)."""
    policy = lora_policy
    g = policy.cfg.train.group_size
    first, second = rollout_of(policy, policy.train_items[:2]), rollout_of(policy, policy.train_items[2:4])
    second.group = second.group + 2  # the sampler's ids are unique over a run
    rows = [torch.arange(g, 2 * g), torch.arange(2 * g)]  # the second group of the first, both of the second
    merged = policy.merge_groups([first, second], rows)
    assert merged.group.tolist() == [1] * g + [2] * g + [3] * g and len(merged.data["prompts"]) == 3
    assert merged.reward_batch.completions == first.reward_batch.completions[g:] + second.reward_batch.completions
    expected = torch.cat([relogp(policy, first)[0][g:], relogp(policy, second)[0]])
    got = relogp(policy, merged)[0]
    for row, (a, b) in enumerate(zip(got, expected)):
        n = int(merged.data["mask"][row].sum())
        torch.testing.assert_close(a[:n], b[:n], atol=1e-5, rtol=0)  # the same tokens under the same prompt
    assert not merged.data["mask"][:, max(first.data["ids"].shape[1], second.data["ids"].shape[1]):].any()
    c = merged.counters
    assert c["tokens/rollout"] == first.counters["tokens/rollout"] + second.counters["tokens/rollout"]
    assert c["tokens/completion"] == pytest.approx(merged.data["mask"].sum(1).float().mean().item())


def test_truncated_completions_are_masked(lora_policy):
    policy = lora_policy
    items = policy.train_items[:2]
    rollout = rollout_of(policy, items)
    truncated = torch.tensor([m["truncated"] for m in rollout.reward_batch.meta])
    full = rollout.data["mask"]
    assert truncated.any(), "6 tokens from a random model should hit the limit"
    assert not rollout.mask[truncated.to(full.device)].any()
    assert torch.equal(rollout.mask[~truncated], full[~truncated])
    assert full[truncated].all(dim=1).all() and full.shape[1] == policy.cfg.generation.max_new_tokens
    assert rollout.counters["tokens/truncated_frac"] == pytest.approx(truncated.float().mean().item())
    policy.cfg.generation.mask_truncated = False
    try:
        unmasked = rollout_of(policy, items)
        assert torch.equal(unmasked.mask, unmasked.data["mask"])
    finally:
        policy.cfg.generation.mask_truncated = True


def bad_data(tmp_path: Path, good: int = 3) -> Path:
    """A Video-R1 file: ``good`` valid image questions, then a missing image, a corrupt image and a corrupt video."""
    (tmp_path / "corrupt.png").write_bytes(b"not a png at all")
    (tmp_path / "corrupt.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"\x13" * 64)
    records = [json.loads(line) for line in (DATA / "train.jsonl").read_text().splitlines()]
    images = [r for r in records if r["data_type"] == "image"][:good]
    for r in images:
        r["path"] = str(DATA / r["path"])
    bad = [dict(images[0], path=str(tmp_path / "missing.png")), dict(images[0], path=str(tmp_path / "corrupt.png")),
           dict(images[0], path=str(tmp_path / "corrupt.mp4"), data_type="video")]
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in images + bad))
    return path


def test_bad_media_is_skipped_counted_and_replaced(lora_policy, tmp_path):
    policy = lora_policy
    items = [policy._item(s) for s in read_samples(bad_data(tmp_path), DATA)]
    good, bad = items[:3], items[3:]
    saved = policy.train_items
    policy.train_items = good
    try:
        with pytest.warns(UserWarning, match="skipping"):
            rollout = rollout_of(policy, [bad[0], good[0], bad[1], bad[2]])
        g = policy.cfg.train.group_size
        assert len(rollout) == 4 * g and rollout.group.tolist() == [i for i in range(4) for _ in range(g)]
        assert rollout.counters["data/skipped_media"] == 3 and rollout.counters["data/replaced"] == 3
        assert all(m["source"] != b["sample"].source for m in rollout.reward_batch.meta for b in bad)
        # known-bad items are skipped again without decoding, and still counted
        again = rollout_of(policy, [bad[1], good[1]])
        assert again.counters["data/skipped_media"] == 1
        # every item bad and nothing to replace them with: a clear failure, not an empty rollout
        policy.train_items = bad
        with pytest.raises(RuntimeError, match="no valid training item"):
            rollout_of(policy, bad[:1])
    finally:
        policy.train_items = saved
        policy._bad.clear()


def test_bad_media_stops_the_run_with_on_bad_media_error(lora_policy, tmp_path):
    policy = lora_policy
    items = [policy._item(s) for s in read_samples(bad_data(tmp_path, good=1), DATA)]
    policy.cfg.data.on_bad_media = "error"
    try:
        with pytest.raises(BadItem, match="missing.png.*on_bad_media"):
            rollout_of(policy, items[:2])
    finally:
        policy.cfg.data.on_bad_media = "skip"
        policy._bad.clear()


def test_synced_evaluation_stands_in_for_skipped_items(lora_policy, tmp_path):
    """Under sharded weights (``synced``) a skipped held-out item is stood in for by a valid one, so the process
    makes the same model calls as the others; its answer is dropped, and the rest answer as without syncing."""
    policy = lora_policy
    items = [policy._item(s) for s in read_samples(bad_data(tmp_path, good=2), DATA)]
    good, bad = items[:2], items[2:4]
    calls = []
    hook = policy.vlm.model.register_forward_hook(lambda module, args, kwargs, out: calls.append(
        len(kwargs["input_ids"])), with_kwargs=True)  # rows of each model call
    try:
        with pytest.warns(UserWarning, match="skipping"):
            plain = policy.generate([good[0], bad[0], good[1], bad[1]])
        plain_rows, calls[:] = sum(calls), []
        policy.synced = lambda more: more  # one process: "any process" is this one
        synced = policy.generate([good[0], bad[0], good[1], bad[1]])
    finally:
        policy.synced = None
        hook.remove()
        policy._bad.clear()
    assert synced.completions == plain.completions and len(synced) == 2
    assert [m["source"] for m in synced.meta] == [g["sample"].source for g in good]
    assert sum(calls) > plain_rows  # the stand-ins were sampled too


def test_prompt_over_the_token_budget(lora_policy):
    policy = lora_policy
    long_item = dict(policy.train_items[0], prompt="x" * 300)  # byte-level tokenizer: 300 tokens of text
    policy.cfg.data.max_prompt_tokens = 200
    saved = policy.train_items
    policy.train_items = saved[1:3]
    try:
        with pytest.warns(UserWarning, match="data.max_prompt_tokens"):
            rollout = rollout_of(policy, [long_item, saved[1]])
        assert rollout.counters["data/skipped_too_long"] == 1 and rollout.counters["data/skipped_media"] == 0
        assert all(len(p) < 200 for p in rollout.reward_batch.prompts)
        policy.cfg.data.on_bad_media = "error"
        policy._bad.clear()
        with pytest.raises(BadItem, match="tokens"):
            rollout_of(policy, [long_item])
    finally:
        policy.cfg.data.max_prompt_tokens = 1024
        policy.cfg.data.on_bad_media = "skip"
        policy.train_items = saved
        policy._bad.clear()


def test_a_prompt_is_encoded_once_across_rollouts_and_samples_the_same(lora_policy, monkeypatch):
    """The second rollout of the same prompts takes their encodings from the prompt cache (no media decoded), and
    a rollout from the same RNG state samples the same tokens with the cache as without it."""
    policy, items = lora_policy, lora_policy.train_items[:2]

    def seeded_rollout():
        torch.manual_seed(0)
        return rollout_of(policy, items).data

    monkeypatch.setattr(policy, "prompts", PromptCache(0, prepared_tensors))
    fresh = seeded_rollout()
    monkeypatch.setattr(policy, "prompts", PromptCache(2**30, prepared_tensors))
    first, cached = seeded_rollout(), seeded_rollout()
    assert (policy.prompts.misses, policy.prompts.hits) == (2, 2) and policy.cache.stats()["misses"] == 0
    assert all(a is b for a, b in zip(first["prompts"], cached["prompts"]))
    assert torch.equal(fresh["ids"], cached["ids"]) and torch.equal(fresh["mask"], cached["mask"])


def test_custom_reward_sees_the_inputs_the_model_saw(lora_policy, monkeypatch):
    """A custom ``module:function`` reward, scored by the zoo on a real rollout, gets each sample's media paths and
    decoded images / videos in [0,1]: the tensors that, back in uint8, give the rollout's pixel inputs exactly."""
    import random_vlm

    seen = []
    monkeypatch.setattr(random_vlm, "seen_inputs", lambda batch: seen.append(batch) or [0.0] * len(batch),
                        raising=False)
    policy = lora_policy
    monkeypatch.setattr(policy, "prompts", PromptCache(0, prepared_tensors))  # encode afresh: decode here
    samples = read_samples(DATA / "train.jsonl", DATA)
    items = [policy._item(next(s for s in samples if s.images)), policy._item(next(s for s in samples if s.videos))]
    rollout = rollout_of(policy, items)
    assert policy.cache.stats()["misses"] == 2  # each file decoded once, for the model and the rewards alike
    RewardZoo([RewardSpec(name="random_vlm:seen_inputs")])(rollout.reward_batch)
    meta, g = seen[0].meta, policy.cfg.train.group_size
    assert len(meta) == 2 * g
    for row, item, inputs in zip((0, g), items, rollout.data["prompts"]):
        m, sample = meta[row], item["sample"]
        assert m["image_paths"] == [str(p) for p in sample.images]
        assert m["video_paths"] == [str(p) for p in sample.videos]
        assert all(t.dtype == torch.uint8 for t in m["images"] + m["videos"])
        assert m["frames"] == sum(v.shape[0] for v in m["videos"]) and len(m["video_fps"]) == len(m["videos"])
        again = policy.vlm.prompt_inputs(item["prompt"], m["images"], m["videos"], m["video_fps"])
        assert again.keys() == inputs.keys() and all(torch.equal(again[k], inputs[k]) for k in inputs)
        assert all(meta[row + k]["images"] is m["images"] for k in range(g))  # shared by the group, not copied
    image, video = meta[0]["images"], meta[g]["videos"]
    assert len(image) == 1 and not meta[0]["videos"] and len(video) == 1 and not meta[g]["images"]
    grid = rollout.data["prompts"][0]["image_grid_thw"][0].tolist()
    assert image[0].shape == (3, grid[1] * 14, grid[2] * 14)
    expected = load_image(items[0]["sample"].images[0], policy.cfg.video)
    assert torch.equal(image[0], expected)
    grid = rollout.data["prompts"][1]["video_grid_thw"][0].tolist()
    assert video[0].shape == (grid[0] * 2, 3, grid[1] * 14, grid[2] * 14) and video[0].shape[0] == 4
    frames, fps = decode_video(items[1]["sample"].videos[0], policy.cfg.video)
    assert torch.equal(video[0], frames) and meta[g]["video_fps"] == [fps]


def test_generate_and_save_samples(lora_policy, tmp_path):
    policy = lora_policy
    _, held = policy.datasets()
    batch = policy.generate(held[:2] + [{"prompt": "Say hi."}])
    assert len(batch) == 3 and batch.meta[2] == {"image_paths": [], "video_paths": [], "images": [], "videos": [],
                                                 "video_fps": [], "frames": 0, "truncated": batch.meta[2]["truncated"]}
    again = policy.generate(held[:2])
    assert again.completions == batch.completions[:2]  # greedy at eval_temperature 0
    files = policy.save_samples(batch, tmp_path, "eval")
    text = files[0].read_text()
    assert "Say hi." in text and "Rewards not computed" in text  # the free prompt has no ground truth
    text = policy.save_samples(again, tmp_path, "eval2")[0].read_text()
    assert "**Rewards**: format 0.000, accuracy" in text and held[0]["prompt"] in text


def test_a_free_prompt_with_a_media_marker_is_a_one_line_error_before_any_sampling(lora_policy, monkeypatch):
    """``mmgrpo sample --prompt`` texts carry no images or videos: an ``<image>`` marker in one cannot be placed
    (it was a ValueError traceback from the processor call, after the items before it had been sampled)."""
    _, held = lora_policy.datasets()
    monkeypatch.setattr(lora_policy, "_try_prepare", lambda *a: pytest.fail("sampled before the check"))
    with pytest.raises(BadItem, match=r"^--prompt 'What is in <image>\?': .*1 <image> .* markers.*no images") as err:
        lora_policy.generate(held[:1] + [{"prompt": "What is in <image>?"}])
    assert "\n" not in str(err.value)


def test_generate_leaves_the_global_rng_alone(lora_policy):
    """Evaluation inside a run must not move the RNG the training rollouts draw from; sampled evaluations of one
    policy repeat exactly."""
    policy = lora_policy
    _, held = policy.datasets()
    before = policy.cfg.generation.eval_temperature
    policy.cfg.generation.eval_temperature = 1.0
    try:
        state = torch.get_rng_state()
        first = policy.generate(held[:3])
        assert torch.equal(torch.get_rng_state(), state)
        torch.manual_seed(123)  # a different global state changes nothing either
        assert policy.generate(held[:3]).completions == first.completions
    finally:
        policy.cfg.generation.eval_temperature = before


def test_generate_per_prompt_samples_k_seeded_completions_that_regenerate_alone(lora_policy, monkeypatch):
    """``mmgrpo sample --per-prompt K``: K completions per item at ``generation.eval_temperature``, grouped, each
    from its own per-row generator; its recorded seed, given as the item's ``seed``, regenerates it alone."""
    policy = lora_policy
    _, held = policy.datasets()
    monkeypatch.setattr(policy.cfg.generation, "eval_temperature", 1.5)
    many = policy.generate(held[:2], per_prompt=3)
    assert many.group.tolist() == [0, 0, 0, 1, 1, 1] and many.prompts == [held[0]["prompt"]] * 3 + [
        held[1]["prompt"]] * 3
    seeds = [m["seed"] for m in many.meta]
    assert all(isinstance(s, int) for s in seeds) and len(set(seeds)) == 6
    assert len(set(many.completions[:3])) > 1 and len(set(many.completions[3:])) > 1
    assert policy.generate(held[:2], per_prompt=3).completions == many.completions
    fewer = policy.generate(held[1:2], per_prompt=2)  # sample k depends neither on K nor on the batch
    assert [m["seed"] for m in fewer.meta] == seeds[3:5] and fewer.completions == many.completions[3:5]
    alone = policy.generate([{**held[0], "seed": seeds[2]}])
    assert alone.completions == many.completions[2:3] and alone.meta[0]["seed"] == seeds[2]
    assert "seed" not in policy.generate(held[:1]).meta[0]  # one per item: the batch's shared generator, as before


def test_generate_per_prompt_refuses_identical_greedy_samples(lora_policy):
    _, held = lora_policy.datasets()
    assert lora_policy.cfg.generation.eval_temperature == 0
    with pytest.raises(ConfigError, match=r"^bad value for 'generation.eval_temperature': 0 .*identical") as err:
        lora_policy.generate(held[:1], per_prompt=2)
    assert "\n" not in str(err.value)


MOVE = ("generation.mask_truncated=false", "grpo.kl_beta=0.1", "grpo.kl_estimator=k1")
"""k1's gradient is 1 per token even at the reference, so one update moves the weights whatever the rewards."""


def run_trainer(cfg) -> tuple[Trainer, list[dict]]:
    trainer = Trainer(cfg)
    return trainer, trainer.train()


@pytest.mark.parametrize("overrides", [
    ("grpo.loss=reinforce", "grpo.ratio_level=sequence", "grpo.loss_aggregation=seq-mean-token-sum-norm",
     "grpo.kl_estimator=k1", "train.num_inner_epochs=2", "train.max_steps=2"),
    ("grpo.loss=ppo_clip", "grpo.loss_aggregation=seq-mean-token-mean", "grpo.kl_estimator=k2",
     "train.updates_per_rollout=2", "train.max_steps=2", "prefix_grouper=false"),
])
def test_loss_options_start_on_policy_and_stay_finite(tmp_path, overrides):
    cfg = config(tmp_path, overrides=("train.prompts_per_step=1", "generation.mask_truncated=false",
                                      "grpo.kl_beta=0.1", "optim.lr=0.05", *overrides), varied=True)
    _, history = run_trainer(cfg)
    assert len(history) == 2
    assert history[0]["ratio/onpolicy_max_dev"] <= 1e-5 and history[0]["kl"] == 0.0
    for row in history:
        assert math.isfinite(row["loss"]) and math.isfinite(row["kl"]) and row["tokens/train"] > 0
    # the second update of the rollout is off-policy once the first one moved the weights (with k1 the KL alone
    # has a gradient at init; with k2 a group of equal rewards may leave them in place)
    assert history[1]["ratio/max_dev"] > 0 or history[0]["grad_norm"] == 0
    assert "k1" not in str(overrides) or history[1]["ratio/max_dev"] > 0


def test_refill_trains_on_a_rollout_merged_from_several_rounds(tmp_path):
    # the random model never writes the tags, so every group of the format reward lacks signal: both refill rounds
    # run and the merged rollout (three rounds' groups, each process's share kept) is what the update sees
    cfg = config(tmp_path, overrides=("grpo.mask_zero_std_groups=true", "grpo.refill_rounds=2", "train.max_steps=2",
                                      "generation.mask_truncated=false", "grpo.kl_beta=0.1"))
    cfg.rewards = [r for r in cfg.rewards if r.name == "format"]
    _, history = run_trainer(cfg)
    assert [r["dynamic/rounds"] for r in history] == [2.0, 2.0]
    assert [r["dynamic/groups_sampled"] for r in history] == [6.0, 6.0]  # 2 prompts per round
    assert all(r["dynamic/signal_frac"] == 0 for r in history)
    assert history[0]["ratio/onpolicy_max_dev"] <= 1e-5  # old log-probs of the merged rows, from its forward


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # raised inside PEFT
def test_lora_checkpoint_loads_with_peft(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    cfg = config(tmp_path, overrides=("train.max_steps=1", "train.prompts_per_step=1", "optim.lr=0.05", *MOVE))
    trainer, _ = run_trainer(cfg)
    folder = Path(cfg.output_dir) / "checkpoints" / "step-1" / "policy"
    assert (folder / "adapter_model.safetensors").is_file()
    base = AutoModelForImageTextToText.from_pretrained(trainer.policy.vlm.path)
    loaded = PeftModel.from_pretrained(base, folder)
    mine = {n: p for n, p in trainer.policy.model.named_parameters() if "lora_" in n}
    theirs = dict(loaded.named_parameters())
    assert mine and all(torch.equal(p, theirs[n]) for n, p in mine.items())
    assert any(n.endswith("lora_B.default.weight") and p.abs().sum() > 0 for n, p in mine.items())
    fresh = VLMPolicy(cfg)
    fresh.load(folder)
    assert all(torch.equal(p, dict(fresh.model.named_parameters())[n]) for n, p in mine.items())
    with pytest.raises(ConfigError) as err:  # the checkpoint given as model.path: the error says how to load it
        VLMModel(replace(cfg.model, path=str(folder.parent)))
    assert str(err.value).endswith(f"set model.path={cfg.model.path} resume={folder.parent}")

    # the adapter as model.path: its base with the adapter merged in, a full model to train (and the reference)
    initial = AutoModelForImageTextToText.from_pretrained(trainer.policy.vlm.path).state_dict()
    merged = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(trainer.policy.vlm.path),
                                       folder).merge_and_unload().state_dict()
    started = VLMModel(replace(cfg.model, path=str(folder), lora_rank=0), keep_reference=True)
    assert started.base_path == trainer.policy.vlm.path and started.processor.tokenizer is not None
    state = started.model.state_dict()
    assert state.keys() == merged.keys() and all(torch.equal(v, merged[k]) for k, v in state.items())
    adapted = [k for k in state if k.endswith("q_proj.weight")]  # a LoRA target: moved by the merge
    assert adapted and not any(torch.equal(state[k], initial[k]) for k in adapted)
    assert all(torch.equal(v, state[k]) for k, v in started.reference_model.state_dict().items())
    vision = tuple(f"{name}." for name in module_names(started.model, VISION_MODULES))
    assert vision and all(p.requires_grad != (cfg.model.freeze_vision and n.startswith(vision))  # trains as loaded
                          for n, p in started.model.named_parameters())
    with pytest.raises(ConfigError, match=r"^model.lora_rank: .* is a PEFT adapter.*set model.lora_rank=0"):
        VLMModel(replace(cfg.model, path=str(folder)))  # a LoRA on the merged model: no base to load it onto


def test_full_checkpoint_loads_with_transformers(tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    cfg = config(tmp_path, "tiny_video_tgrpo", ("train.max_steps=1", "train.prompts_per_step=1", "optim.lr=0.01",
                                                 *MOVE))
    trainer, history = run_trainer(cfg)
    assert history[0]["ratio/onpolicy_max_dev"] <= 1e-5 and history[0]["grad_norm"] > 0
    folder = Path(cfg.output_dir) / "checkpoints" / "step-1" / "policy"
    loaded = AutoModelForImageTextToText.from_pretrained(folder)
    AutoProcessor.from_pretrained(folder)
    state = trainer.policy.model.state_dict()
    assert all(torch.equal(v, state[k]) for k, v in loaded.state_dict().items())
    start = AutoModelForImageTextToText.from_pretrained(trainer.policy.vlm.path).state_dict()
    assert any(not torch.equal(v, start[k]) for k, v in loaded.state_dict().items())
    shutil.rmtree(Path(cfg.output_dir) / "checkpoints")


def test_bad_data_fails_before_the_model_loads(tmp_path):
    """The data files are read and checked before any weights: with a model path that does not exist, the error
    is still the data file's, naming its line."""
    lines = (DATA / "train.jsonl").read_text().splitlines()[:3]
    broken = tmp_path / "broken.jsonl"
    broken.write_text("\n".join([lines[0], lines[1][:40], lines[2]]) + "\n")
    absent = f"model.path={tmp_path / 'no-such-model'}"
    with pytest.raises(ConfigError, match=r"broken\.jsonl:2: malformed JSON"):
        VLMPolicy(config(tmp_path, overrides=(absent, f"data.train_file={broken}")))
    marked = tmp_path / "marked.jsonl"
    record = {"problem": "<image><image>Same?", "answer": "yes", "images": ["images/colour_00.png"]}
    marked.write_text(json.dumps(record))
    with pytest.raises(ConfigError, match=r"marked\.jsonl:1: the prompt has 2 <image>"):
        VLMPolicy(config(tmp_path, overrides=(absent, f"data.eval_file={marked}")))
    with pytest.raises(ConfigError, match="model.path"):  # the data is fine: now the model path is the error
        VLMPolicy(config(tmp_path, overrides=(absent,)))


def test_unavailable_backend_and_bad_values_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="generation.backend.*not available"):
        VLMPolicy(config(tmp_path, overrides=("generation.backend=vllm",)))
    with pytest.raises(ConfigError, match="data.on_bad_media"):
        VLMPolicy(config(tmp_path, overrides=("data.on_bad_media=ignore",)))
    with pytest.raises(ConfigError, match="data.media_types"):
        VLMPolicy(config(tmp_path, overrides=("data.media_types=[audio]",)))
    with pytest.raises(ConfigError, match=r"data.type_instructions.*\['mcq'\].*multiple choice"):
        VLMPolicy(config(tmp_path, overrides=("data.type_instructions={mcq: ' Letter only.'}",)))
    told = config(tmp_path, overrides=("data.type_instructions={temporal grounding: ' [start, end] in seconds.'}",))
    assert list(told.data.type_instructions) == ["temporal grounding"]  # a type the data reads (temporal_iou's)
    with pytest.raises(ConfigError, match=r"video.size_factor: 28 px .*tiny:qwen3_vl.* set video.size_factor=32"):
        VLMPolicy(config(tmp_path, overrides=("model.path=tiny:qwen3_vl",)))  # 16-px patches, merged 2 x 2
    with pytest.raises(ConfigError, match=r"video.frame_multiple: 3 is not a multiple of the 2 frames .* set "
                                          r"video.frame_multiple=2"):  # a partial temporal patch
        VLMPolicy(config(tmp_path, overrides=("video.frame_multiple=3", "video.max_frames=6")))
    # checked on the configured value: on CPU flash_attention_2 would fall back to sdpa and hide the clash
    with pytest.raises(ConfigError, match="model.attn_implementation"):
        VLMPolicy(config(tmp_path, overrides=("model.attn_implementation=flash_attention_2", "prefix_grouper=true")))


@pytest.mark.parametrize("prefix_grouper", [True, False])
def test_an_unknown_attention_names_the_key_and_the_choices_when_the_config_loads(tmp_path, prefix_grouper):
    """A typo (flash_attn) was a 'model.path: cannot load' error after reading the data, or, with the Prefix
    Grouper, a claim that flash_attn cannot take a block mask."""
    with pytest.raises(ConfigError, match=r"bad value 'flash_attn' for 'model.attn_implementation': expected one of "
                                          r"sdpa, eager, flash_attention_2, "):
        config(tmp_path, overrides=("model.attn_implementation=flash_attn", f"prefix_grouper={prefix_grouper}"))


@pytest.mark.parametrize("attention", ["flash_attention_3", "flex_attention"])
def test_prefix_grouper_with_an_attention_that_takes_no_block_mask_fails_when_the_config_loads(tmp_path, attention):
    """Only sdpa and eager take the Prefix Grouper's block mask: any other kernel would fail at the first training
    forward, after a whole rollout, with a traceback."""
    with pytest.raises(ConfigError, match=rf"{attention} cannot take: set 'model.attn_implementation'.*"
                                          r"prefix_grouper=false"):
        config(tmp_path, overrides=(f"model.attn_implementation={attention}", "prefix_grouper=true"))
    config(tmp_path, overrides=(f"model.attn_implementation={attention}", "prefix_grouper=false"))


def test_two_processes_train_a_vision_tower_on_images_mixed_with_text_only_questions(train_on_two_processes,
                                                                                     tmp_path):
    """tiny_image trains the vision tower; with every second question text-only, a step where one process draws
    only text-only groups used to leave the tower without gradients there, and DDP's all-reduce waited forever
    (the launch timed out). Balanced tower calls keep the processes in step and their weights identical."""
    lines = (ROOT / "assets" / "data" / "shapes_qa" / "train.jsonl").read_text().splitlines()[:16]
    records = [json.loads(line) for line in lines]
    for record in records[1::2]:
        del record["path"], record["data_type"]
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join(json.dumps(r) + "\n" for r in records))
    report = train_on_two_processes(ROOT / "configs" / "vlm" / "tiny_image.yaml", "train.max_steps=2",
                                    "train.prompts_per_step=2", f"data.train_file={mixed}", "data.media_types=[image,text]",
                                    f"data.root={ROOT / 'assets' / 'data' / 'shapes_qa'}", "grpo.kl_beta=0")
    assert report["num_processes"] == 2 and report["param_rank_diff"] == 0.0 and report["param_change"] > 0


def test_two_processes_train_tgrpo_with_the_prefix_grouper_in_sync(train_on_two_processes):
    """The shipped T-GRPO preset (video, shuffled-frame rollouts, temporal bonus per group, full fine-tune with a
    frozen reference) with the Prefix Grouper under two gloo DDP processes: exactly on-policy, identical weights."""
    report = train_on_two_processes(ROOT / "configs" / "vlm" / "tiny_video_tgrpo.yaml", "train.max_steps=2",
                                    "prefix_grouper=true", "generation.max_new_tokens=16")
    assert report["num_processes"] == 2 and report["onpolicy_max_dev"] <= 1e-5
    assert report["param_rank_diff"] == 0.0 and report["param_change"] > 0


def test_eval_with_every_held_out_item_skipped_is_an_error_not_an_empty_result(tmp_path, monkeypatch, capsys):
    """Every held-out image unreadable (skipped under on_bad_media: skip): `mmgrpo eval` says so and exits 1
    instead of writing an eval.json of 0 samples and NaN means."""
    from mmgrpo.cli import main

    monkeypatch.chdir(ROOT)
    lines = (ROOT / "assets" / "data" / "shapes_qa" / "heldout.jsonl").read_text().splitlines()[:3]
    for i in range(3):
        (tmp_path / f"torn{i}.png").write_bytes(b"\x89PNG torn")
    records = [{**json.loads(line), "path": str(tmp_path / f"torn{i}.png")} for i, line in enumerate(lines)]
    gone = tmp_path / "gone.jsonl"
    gone.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "run"
    assert main(["eval", "configs/vlm/tiny_image.yaml", f"data.eval_file={gone}", "data.num_eval=3",
                 f"output_dir={out}", "logging.progress=false"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "error: none of the 3 held-out items could be evaluated: all were skipped"
    assert not (out / "eval.json").exists()

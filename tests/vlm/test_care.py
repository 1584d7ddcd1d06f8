"""GRPO-CARE: the per-group consistency bonus (closed forms and properties), the answer-token mask, the answer
likelihood, and the EMA reference in the rollout, the optimiser-step hook and checkpoints."""

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from random_vlm import RANDOM_TINY_VLM
from transformers import AutoTokenizer

from mmgrpo.config import ConfigError, RewardSpec, load_config
from mmgrpo.pipelines.vlm import care
from mmgrpo.pipelines.vlm.policy import VLMPolicy, check_config
from mmgrpo.pipelines.vlm.tiny import build_tokenizer
from mmgrpo.rewards import RewardBatch, RewardZoo, build_reward
from mmgrpo.rewards.consistency_bonus import LIKELIHOOD_KEY, consistency_bonus
from mmgrpo.trainer import POLICY_STATE_FILE, Trainer

ROOT = Path(__file__).resolve().parents[2]
NAN = math.nan


def one_group(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.long)


def test_accurate_rollouts_near_their_mean_likelihood_get_their_accuracy():
    # mean accuracy 0.75: rows 0, 1, 3 are accurate; their mean likelihood is (0.9 + 0.5 + 0.8) / 3 = 0.7333, so
    # with margin 0.01 the cut is 0.7233: rows 0 and 3 are picked, row 1 (correct, unlikely answer) is not
    bonus = consistency_bonus(torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([0.9, 0.5, 0.99, 0.8]), one_group(4))
    assert bonus.tolist() == [1.0, 0.0, 0.0, 1.0]
    # a margin that reaches 0.5 pays row 1 too; the wrong row 2 never gets anything, however likely
    bonus = consistency_bonus(torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([0.9, 0.5, 0.99, 0.8]), one_group(4),
                              margin=0.25)
    assert bonus.tolist() == [1.0, 1.0, 0.0, 1.0]


def test_partial_credit_needs_the_group_mean_and_the_threshold():
    # OCR-like scores: mean 0.3625, so only the two 0.6 rows are accurate (0.2 is below the mean, 0.05 below 0.1)
    acc = torch.tensor([0.6, 0.2, 0.05, 0.6])
    bonus = consistency_bonus(acc, torch.tensor([0.5, 0.9, 0.9, 0.5]), one_group(4))
    assert bonus.tolist() == pytest.approx([0.6, 0.0, 0.0, 0.6])
    # every rollout at 0.05: the mean is met but the threshold is not; at 0.1 it is not exceeded either
    assert consistency_bonus(torch.full((3,), 0.05), torch.full((3,), 0.9), one_group(3)).tolist() == [0.0] * 3
    at_threshold = torch.full((3,), 0.1, dtype=torch.float64)  # float32's 0.1 is above 0.1
    assert consistency_bonus(at_threshold, torch.full((3,), 0.9), one_group(3)).tolist() == [0.0] * 3


@pytest.mark.parametrize("n", [3, 5, 6, 7, 12])
def test_a_group_of_equal_partial_scores_is_accurate_although_their_float_mean_rounds_above_them(n):
    # at n = 6 the float64 mean of six 0.7 is one ulp above 0.7: a plain >= picked no rollout
    assert consistency_bonus(torch.full((n,), 0.7, dtype=torch.float64), torch.full((n,), 0.5),
                             one_group(n)).tolist() == [0.7] * n


def test_likelihoods_are_clamped_so_near_certain_answers_tie():
    # 0.999 and 0.96 both clamp to 0.95: no rank on noise above the bound; unclamped, 0.96 < 0.9795 - 0.01
    acc, like = torch.ones(2), torch.tensor([0.999, 0.96])
    assert consistency_bonus(acc, like, one_group(2)).tolist() == [1.0, 1.0]
    assert consistency_bonus(acc, like, one_group(2), likelihood_max=1.0).tolist() == [1.0, 0.0]


def test_no_answer_is_never_picked_and_a_group_without_accurate_rollouts_gets_nothing():
    bonus = consistency_bonus(torch.tensor([1.0, 1.0, 0.0]), torch.tensor([NAN, 0.4, 0.9]), one_group(3))
    assert bonus.tolist() == [0.0, 1.0, 0.0]  # the NaN row neither gets the bonus nor drags the mean
    assert consistency_bonus(torch.zeros(3), torch.full((3,), 0.9), one_group(3)).tolist() == [0.0] * 3
    assert consistency_bonus(torch.tensor([NAN, 1.0]), torch.tensor([0.9, 0.9]), one_group(2)).tolist() == [0, 1.0]


def test_selection_is_made_per_group_not_per_batch():
    # group 3 answers with likelihoods 0.2-0.3, group 8 with 0.9: pooled (GRPO-CARE's code pools the local batch),
    # the mean 0.6 would leave every rollout of group 3 without a bonus
    acc = torch.ones(4)
    like = torch.tensor([0.2, 0.3, 0.9, 0.9])
    group = torch.tensor([3, 3, 8, 8])
    assert consistency_bonus(acc, like, group).tolist() == [0.0, 1.0, 1.0, 1.0]
    assert consistency_bonus(acc, like, one_group(4)).tolist() == [0.0, 0.0, 1.0, 1.0]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0.0, 0.3, 1.0]), st.floats(0.0, 1.0), st.integers(0, 2)), min_size=1,
                max_size=12), st.randoms(use_true_random=False))
def test_bonus_is_zero_or_the_accuracy_and_each_group_decides_alone(rows, rng):
    acc = torch.tensor([a for a, _, _ in rows], dtype=torch.float64)
    like = torch.tensor([p for _, p, _ in rows], dtype=torch.float64)
    group = torch.tensor([g for _, _, g in rows])
    bonus = consistency_bonus(acc, like, group)
    assert bool(((bonus == 0) | (bonus == acc)).all())
    # permuting rows permutes the bonus; the bonus of group 0 is what group 0 alone gets
    order = list(range(len(rows)))
    rng.shuffle(order)
    assert torch.equal(consistency_bonus(acc[order], like[order], group[order]), bonus[order])
    alone = group == 0
    if alone.any():
        assert torch.equal(consistency_bonus(acc[alone], like[alone], group[alone]), bonus[alone])


def answer(letter: str) -> str:
    return f"<think>t</think><answer>{letter}</answer>"


def test_reward_reads_the_likelihoods_and_is_left_out_of_evaluation():
    meta = {"problem_type": "multiple choice", "solution": "<answer>B</answer>"}
    batch = RewardBatch(prompts=["q"] * 4, group=one_group(4), completions=[answer("B"), answer("B"), answer("A"),
                                                                             "none"],
                        meta=[{**meta, LIKELIHOOD_KEY: p} for p in (0.9, 0.3, 0.9, NAN)])
    reward = build_reward("consistency_bonus", {})
    assert reward.kind == "groupwise" and reward.rollout_only
    assert reward(batch).tolist() == [1.0, 0.0, 0.0, 0.0]  # accurate B's: mean likelihood 0.6, cut 0.59
    held_out = RewardBatch(prompts=["q"], group=one_group(1), completions=[answer("B")], meta=[meta])
    assert reward(held_out).isnan().all()  # no likelihoods: does not apply
    zoo = RewardZoo([RewardSpec(name="accuracy"), RewardSpec(name="consistency_bonus", weight=0.5)])
    assert zoo.evaluation_names == ["accuracy"]
    with pytest.raises(ValueError, match="margin"):
        build_reward("consistency_bonus", {"margin": -0.1})


# ------------------------------------------------------------------------------------------------ answer tokens
def encode(tokenizer, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (N,L) ids and mask of ``texts``, each followed by EOS, as the sampler returns them."""
    rows = [tokenizer(t, add_special_tokens=False).input_ids + [tokenizer.eos_token_id] for t in texts]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), True
    return ids, mask


BYTE_TOKENIZER = build_tokenizer()  # no merges, tags not added: "<answer>" is 8 byte tokens
SHIPPED_TOKENIZER = AutoTokenizer.from_pretrained(str(ROOT / "assets" / "tiny-qwen2vl-shapes"))
"""Task words and tags are single tokens."""


@pytest.mark.parametrize("tokenizer", [BYTE_TOKENIZER, SHIPPED_TOKENIZER], ids=["bytes", "shipped"])
def test_answer_mask_spells_the_last_answer_block(tokenizer):
    texts = ["<think>the circle is red</think><answer>A</answer>", "<think>x</think><answer> two </answer>",
             "no answer here", "<answer>B</answer> then <answer>C</answer>", "<think>y</think><answer></answer>"]
    ids, mask = encode(tokenizer, texts)
    answer = care.answer_token_mask(tokenizer, ids, mask)
    spelled = [tokenizer.decode(ids[i][answer[i]]) for i in range(len(texts))]
    assert spelled == ["A", " two ", "", "C", ""]
    assert not (answer & ~mask).any()


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet="ab <>/é", max_size=12), st.text(alphabet="abc 12.é", min_size=1, max_size=8))
def test_answer_mask_covers_exactly_the_answer_text_on_byte_tokens(think, content):
    text = f"<think>{think}</think><answer>{content}</answer>"
    ids, mask = encode(BYTE_TOKENIZER, [text])
    answer = care.answer_token_mask(BYTE_TOKENIZER, ids, mask)
    assert BYTE_TOKENIZER.decode(ids[0][answer[0]]) == content


def test_answer_likelihood_is_the_geometric_mean_of_the_answer_probabilities():
    logp = torch.log(torch.tensor([[0.5, 0.8, 0.2, 1.0], [0.9, 0.9, 0.9, 0.9]]))
    answer = torch.tensor([[False, True, True, False], [False, False, False, False]])
    like = care.answer_likelihood(logp, answer)
    assert like[0].item() == pytest.approx(math.sqrt(0.8 * 0.2)) and math.isnan(like[1])


# ------------------------------------------------------------------------------------------------ in the policy
pytestmark = pytest.mark.usefixtures("one_thread")


def care_config(tmp_path, *overrides):
    return load_config(ROOT / "configs" / "vlm" / "tiny_image_care.yaml", [
        *RANDOM_TINY_VLM, f"output_dir={tmp_path}", "generation.max_new_tokens=8", "train.group_size=3",
        "train.micro_batch_size=3", "train.prompts_per_step=2", "data.media_types=[image]",
        "generation.mask_truncated=false", *overrides])  # the random model rarely ends within 8 tokens


def test_care_and_its_reward_must_agree(tmp_path):
    cfg = care_config(tmp_path)
    assert care.bonus_spec(cfg).name == "consistency_bonus"
    without_reward = replace(cfg, rewards=[r for r in cfg.rewards if r.name != "consistency_bonus"])
    with pytest.raises(ConfigError, match="care.enabled needs exactly one 'consistency_bonus'"):
        check_config(without_reward, runnable_here=False)
    with pytest.raises(ConfigError, match=r"rewards.2: the consistency_bonus reward needs care.enabled"):
        care_config(tmp_path, "care.enabled=false")


def test_rollout_scores_answers_under_the_reference_and_the_reference_follows_every_k_steps(tmp_path):
    cfg = care_config(tmp_path, "care.update_every=2", "care.ema_decay=0.5")
    policy = VLMPolicy(cfg)
    items = policy.train_items[:2]
    with torch.no_grad():
        rollout = policy.rollout(items, [0, 1], 3)
    meta = rollout.reward_batch.meta
    like = torch.tensor([m[LIKELIHOOD_KEY] for m in meta], dtype=torch.float64)
    # the reference starts as the policy: the likelihood is the policy's own, from the training forward (NaN for
    # every answerless completion of the random model; the values are checked by the test below)
    with torch.no_grad():
        logp = policy.log_probs(rollout, torch.arange(len(rollout)), None, with_kl=False).logp
    answer = care.answer_token_mask(policy.vlm.tokenizer, rollout.data["ids"], rollout.data["mask"])
    expected = care.answer_likelihood(logp, answer)
    assert torch.allclose(like, expected, equal_nan=True, atol=1e-6)
    c = rollout.counters
    assert c["care/answer_found_frac"] == pytest.approx((~like.isnan()).double().mean().item())
    # steps 1 and 2 of a run: the reference moves only at step 2, halfway to the policy (decay 0.5)
    name, param = next((n, p) for n, p in policy.model.named_parameters() if p.requires_grad)
    start = policy.care_reference.shadow[name].clone()
    with torch.no_grad():
        param.add_(1.0)
    policy.after_optimizer_step(1)
    assert torch.equal(policy.care_reference.shadow[name], start)
    policy.after_optimizer_step(2)
    assert torch.allclose(policy.care_reference.shadow[name], start + 0.5)
    # scoring under the reference leaves the policy's weights as they were
    before = param.detach().clone()
    with torch.no_grad():
        policy.rollout(items, [0, 1], 3)
    assert torch.equal(param, before)


def test_answer_likelihoods_are_the_references_not_the_policys(tmp_path):
    """The random model's completions hold no answer block, so the rollout's likelihoods above are all NaN and agree
    with any scorer; these completions answer. Scored once while the reference is the policy, they score the same
    after the policy moved (the reference did not), and not what the moved policy gives them."""
    policy = VLMPolicy(care_config(tmp_path))
    with torch.no_grad():
        rollout = policy.rollout(policy.train_items[:2], [0, 1], 3)
    texts = ["<think>a b</think><answer>A</answer>", "<answer>B</answer>", "no answer",
             "<think>c</think><answer>two</answer>", "<answer>C. red</answer>", "<think></think><answer>D</answer>"]
    ids, mask = encode(policy.vlm.tokenizer, texts)
    data = {**rollout.data, "ids": ids, "mask": mask}
    before = policy._answer_likelihoods(data)
    assert before.isnan().tolist() == [False, False, True, False, False, False]
    trainable = [p for p in policy.model.parameters() if p.requires_grad]
    with torch.no_grad():
        for i, p in enumerate(trainable):
            p.add_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
        own = torch.cat([policy._logprobs(policy.unwrapped_model(), data, rows)[0]
                         for rows in torch.arange(len(texts)).split(policy.cfg.train.micro_batch_size)])
    moved = care.answer_likelihood(own, care.answer_token_mask(policy.vlm.tokenizer, ids, mask)).double()
    found = ~before.isnan()
    torch.testing.assert_close(policy._answer_likelihoods(data), before, equal_nan=True, rtol=0, atol=1e-6)
    assert (moved.log() - before.log())[found].abs().max() > 0.05, (moved, before)


def test_training_is_on_policy_and_a_resume_restores_the_reference(tmp_path):
    cfg = care_config(tmp_path, "train.max_steps=2", "train.save_every=2", "care.update_every=1", "optim.lr=0.01")
    # the random model earns no format or accuracy reward; a length reward varies, so the weights move
    cfg = replace(cfg, rewards=[RewardSpec(name="length", args={"max_len": 5, "slack": 20}), *cfg.rewards])
    trainer = Trainer(cfg)
    history = trainer.train()
    trainer.close()
    assert history[0]["ratio/onpolicy_max_dev"] <= 1e-6
    assert {"care/answer_likelihood", "care/answer_found_frac", "reward/consistency_bonus/mean"} <= set(history[0])
    saved = trainer.policy.training_state()
    assert (tmp_path / "checkpoints" / "step-2" / POLICY_STATE_FILE).is_file()
    resumed = Trainer(replace(cfg, resume="latest"))
    fresh = {n: t.clone() for n, t in resumed.policy.training_state().items()}
    resumed.load_checkpoint(tmp_path / "checkpoints" / "step-2")
    state = resumed.policy.training_state()
    assert all(torch.equal(state[n], saved[n]) for n in saved)
    assert any(not torch.equal(fresh[n], saved[n]) for n in saved)  # it moved in training, and was restored
    resumed.close()


def test_care_turned_on_at_a_resume_starts_its_reference_from_the_restored_weights(tmp_path):
    cfg = care_config(tmp_path, "train.max_steps=2", "train.save_every=2", "optim.lr=0.01")
    length = RewardSpec(name="length", args={"max_len": 5, "slack": 20})  # varies on the random model: weights move
    plain = replace(cfg, care=replace(cfg.care, enabled=False), rewards=[length])
    trainer = Trainer(plain)
    trainer.train()
    trainer.close()
    assert not (tmp_path / "checkpoints" / "step-2" / POLICY_STATE_FILE).exists()  # a run without CARE keeps none
    resumed = Trainer(replace(cfg, resume="latest", rewards=[length, *cfg.rewards]))
    fresh = {n: t.clone() for n, t in resumed.policy.training_state().items()}
    resumed.load_checkpoint(tmp_path / "checkpoints" / "step-2")
    params = dict(resumed.policy.model.named_parameters())
    state = resumed.policy.training_state()
    assert all(torch.equal(state[n], params[n].detach().float()) for n in state)  # the restored weights
    assert any(not torch.equal(fresh[n], state[n]) for n in state)  # not the initial ones
    resumed.close()

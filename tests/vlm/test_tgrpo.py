"""T-GRPO: the per-group temporal bonus (closed forms) and the reward that applies it."""

import math
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from random_vlm import RANDOM_TINY_VLM

from mmgrpo.config import ConfigError, RewardSpec, load_config
from mmgrpo.pipelines.vlm import tgrpo
from mmgrpo.pipelines.vlm.data import VLMSample
from mmgrpo.pipelines.vlm.generation import Completions
from mmgrpo.pipelines.vlm.policy import VLMPolicy, check_tgrpo_in_step
from mmgrpo.rewards import RewardBatch, RewardZoo, build_reward
from mmgrpo.rewards.temporal_bonus import SHUFFLED_ACC_KEY, temporal_bonus

NAN = math.nan


def test_one_group_passes_or_fails_on_mu():
    correct = torch.tensor([True, False, True, False])  # ordered accuracy 0.5
    group = torch.zeros(4, dtype=torch.long)
    # 0.5 >= 0.8 * 0.6 = 0.48: pass, each correct rollout gets alpha
    assert temporal_bonus(correct, group, torch.full((4,), 0.6), 0.3, 0.8).tolist() == [0.3, 0.0, 0.3, 0.0]
    # 0.5 < 0.8 * 0.7 = 0.56: fail, nobody gets a bonus
    assert temporal_bonus(correct, group, torch.full((4,), 0.7), 0.3, 0.8).tolist() == [0.0] * 4
    # equality passes (>=): 0.5 >= 1.0 * 0.5
    assert temporal_bonus(correct, group, torch.full((4,), 0.5), 0.3, 1.0).tolist() == [0.3, 0.0, 0.3, 0.0]


def test_bonus_is_decided_per_group_not_per_batch():
    # group 7: 4/4 correct ordered, shuffled 1.0 -> 1.0 >= 0.8: pass.
    # group 9: 1/4 correct ordered, shuffled 0.5 -> 0.25 < 0.4: fail.
    # Pooled over the batch (Video-R1's code): ordered 5/8 = 0.625 >= 0.8 * 0.75 = 0.6 would pass both groups and
    # pay group 9's lucky rollout too.
    correct = torch.tensor([1, 1, 1, 1, 0, 0, 0, 1], dtype=torch.bool)
    group = torch.tensor([7, 7, 7, 7, 9, 9, 9, 9])
    shuffled = torch.tensor([1.0] * 4 + [0.5] * 4)
    bonus = temporal_bonus(correct, group, shuffled, 0.3, 0.8)
    assert bonus.tolist() == pytest.approx([0.3, 0.3, 0.3, 0.3, 0.0, 0.0, 0.0, 0.0])
    pooled = temporal_bonus(correct, torch.zeros(8, dtype=torch.long), torch.full((8,), 0.75), 0.3, 0.8)
    assert pooled[7] == pytest.approx(0.3)  # what the per-batch rule would have paid


def test_groups_need_not_be_contiguous_and_non_video_is_nan():
    correct = torch.tensor([True, True, False, True, False])
    group = torch.tensor([2, 5, 2, 5, 8])
    shuffled = torch.tensor([0.0, 1.0, 0.0, 1.0, NAN])
    bonus = temporal_bonus(correct, group, shuffled, 0.5, 0.8)
    # group 2: 0.5 >= 0 pass; group 5: 1.0 >= 0.8 pass; group 8 is not a video: NaN
    assert bonus[:4].tolist() == [0.5, 0.5, 0.0, 0.5]
    assert math.isnan(bonus[4])


def test_ordered_accuracy_from_scores():
    # Video-R1 tests the group's mean accuracy reward; correct = score > 0.1 gets the bonus
    scores = torch.tensor([0.2, 0.2, 0.0, 0.0])
    correct = scores > 0.1
    group = torch.zeros(4, dtype=torch.long)
    shuffled = torch.full((4,), 0.2)
    # fraction correct 0.5 >= 0.16 passes; mean score 0.1 < 0.16 fails
    assert temporal_bonus(correct, group, shuffled, 0.3, 0.8).tolist() == [0.3, 0.3, 0.0, 0.0]
    assert temporal_bonus(correct, group, shuffled, 0.3, 0.8, accuracy=scores).tolist() == [0.0] * 4


def test_inconsistent_shuffled_accuracy_in_a_group_raises():
    with pytest.raises(ValueError, match="group 0"):
        temporal_bonus(torch.ones(2, dtype=torch.bool), torch.zeros(2, dtype=torch.long),
                       torch.tensor([0.5, 0.25]), 0.3, 0.8)


def answer(letter: str) -> str:
    return f"<think>t</think><answer>{letter}</answer>"


def test_reward_reads_meta_and_scores_accuracy_per_group():
    meta_video = {"problem_type": "multiple choice", "solution": "<answer>B</answer>", "tgrpo_shuffled_acc": 0.5}
    meta_image = {"problem_type": "multiple choice", "solution": "<answer>B</answer>"}
    batch = RewardBatch(
        prompts=["q"] * 6,
        group=torch.tensor([0, 0, 0, 1, 1, 1]),
        completions=[answer("B"), answer("B"), answer("A"), answer("B"), "no answer", answer("A")],
        meta=[meta_video] * 3 + [meta_image] * 3)
    reward = build_reward("temporal_bonus", {"alpha": 0.3, "mu": 0.8})
    assert reward.kind == "groupwise"
    scores = reward(batch)
    # group 0: ordered 2/3 >= 0.4, the two B's get 0.3; group 1 has no shuffled accuracy: NaN
    assert scores[:3].tolist() == pytest.approx([0.3, 0.3, 0.0])
    assert torch.isnan(scores[3:]).all()
    main, logged, _ = RewardZoo([RewardSpec(name="accuracy"), RewardSpec(name="temporal_bonus")])(batch)
    # through the zoo a NaN bonus leaves the accuracy alone in the weighted sum
    assert main[:, 1].tolist()[:3] == pytest.approx([0.3, 0.3, 0.0])
    assert logged["temporal_bonus"].isnan().sum() == 3


def test_evaluation_leaves_the_bonus_out_without_a_warning():
    """Held-out samples have no shuffled rollouts: evaluation scores the other rewards and warns about nothing."""
    zoo = RewardZoo([RewardSpec(name="accuracy"), RewardSpec(name="temporal_bonus")])
    assert zoo.evaluation_names == ["accuracy"]
    meta = {"problem_type": "multiple choice", "solution": "<answer>B</answer>"}
    batch = RewardBatch(prompts=["q"] * 2, group=torch.tensor([0, 1]), completions=[answer("B"), answer("A")],
                        meta=[meta] * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, logged, _ = zoo(batch, only=zoo.evaluation_names)
    assert set(logged) == {"accuracy"} and logged["accuracy"].tolist() == [1.0, 0.0]
    with pytest.warns(RuntimeWarning, match="temporal_bonus"):  # scored anyway, it does not apply
        zoo(batch)


def test_reward_rejects_bad_args():
    with pytest.raises(ValueError, match="alpha"):
        build_reward("temporal_bonus", {"alpha": -1.0})


# ----------------------------------------------------------------------------------------------- in the rollout
ROOT = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("one_thread")


def video_config(tmp_path, *overrides):
    return load_config(ROOT / "configs" / "vlm" / "tiny_video_tgrpo.yaml", [
        *RANDOM_TINY_VLM, f"output_dir={tmp_path}", "data.prompt_template='{question}{options}'",
        "generation.max_new_tokens=6",
        "train.group_size=3", "train.micro_batch_size=3", *overrides])


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    policy = VLMPolicy(video_config(tmp_path_factory.mktemp("tgrpo"), "data.media_types=[image,video]",
                                    "tgrpo.shuffled_group_size=2"))
    policy.datasets()
    return policy


def test_rollout_fills_shuffled_accuracy_for_video_groups_only(policy):
    video = next(i for i in policy.train_items if i["sample"].videos)
    image = next(i for i in policy.train_items if not i["sample"].videos)
    with torch.no_grad():
        rollout = policy.rollout([video, image], [10, 11], 3)
    meta = rollout.reward_batch.meta
    assert len(rollout) == 6 and rollout.group.tolist() == [10] * 3 + [11] * 3  # shuffled answers are not rows
    shuffled = {m[SHUFFLED_ACC_KEY] for m in meta[:3]}
    assert len(shuffled) == 1 and 0.0 <= shuffled.pop() <= 1.0
    assert all(SHUFFLED_ACC_KEY not in m for m in meta[3:])
    assert meta[0]["frames"] == 4 and meta[3]["frames"] == 0
    c = rollout.counters
    assert c["tgrpo/video_groups"] == 1 and 0 < c["tokens/shuffled"] <= 2 * 6
    assert c["tokens/rollout"] == rollout.data["mask"].sum().item() + c["tokens/shuffled"]
    assert {"tgrpo/pass_frac", "tgrpo/shuffled_acc", "tgrpo/ordered_acc"} <= set(c)
    # the bonus reward reads it back: NaN for the image group
    bonus = build_reward("temporal_bonus", {"alpha": 0.3, "mu": 0.8})(rollout.reward_batch)
    assert torch.isnan(bonus[3:]).all() and not torch.isnan(bonus[:3]).any()


def test_held_out_sample_files_leave_the_bonus_out_without_a_warning(policy, tmp_path):
    _, held = policy.datasets()
    with torch.no_grad():
        batch = policy.generate(held[:2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (path,) = policy.save_samples(batch, tmp_path, "step-1")
    text = path.read_text()
    assert text.count("**Rewards**: ") == 2 and "accuracy" in text and "temporal_bonus" not in text


def test_shuffled_rollouts_see_shuffled_frames_and_are_scored_with_accuracy(policy, monkeypatch):
    video = next(i for i in policy.train_items if i["sample"].videos)
    p = policy._prepare(video)
    seen = {}

    def fake_generate(vlm, inputs, count, gen_cfg, generator, synced):
        seen["inputs"], seen["count"] = inputs, count
        texts = [f"<answer>{p.meta()['answer']}</answer>", "<answer>Z</answer>"]
        return Completions(ids=torch.ones(2, 3, dtype=torch.long), mask=torch.ones(2, 3, dtype=torch.bool),
                           truncated=torch.zeros(2, dtype=torch.bool), texts=texts, logprobs=torch.zeros(2, 3))

    monkeypatch.setattr(tgrpo, "generate_group", fake_generate)
    acc, tokens = tgrpo.shuffled_accuracy(policy.vlm, video["prompt"], p.images, p.videos, p.fps, p.meta(), 2,
                                          policy.cfg, policy.accuracy, None, torch.Generator().manual_seed(0))
    assert (acc, tokens, seen["count"]) == (0.5, 6, 2)
    ordered, shuffled = p.inputs["pixel_values_videos"], seen["inputs"]["pixel_values_videos"]
    assert ordered.shape == shuffled.shape and not torch.equal(ordered, shuffled)
    assert torch.equal(p.inputs["input_ids"], seen["inputs"]["input_ids"])


def test_temporal_counters():
    c = tgrpo.temporal_counters([0.5, 0.2, 1.0], [0.5, 0.5, 0.0], 0.8)
    assert c["tgrpo/pass_frac"] == pytest.approx(2 / 3)
    assert c["tgrpo/ordered_acc"] == pytest.approx(1.7 / 3) and c["tgrpo/shuffled_acc"] == pytest.approx(1 / 3)
    assert tgrpo.temporal_counters([], [], 0.8) == {}


def test_temporal_counters_leave_out_groups_the_accuracy_does_not_apply_to():
    """A video group whose accuracy is NaN (e.g. temporal grounding, scored by temporal_iou) gets no bonus (NaN,
    does not apply); it is not a group that failed the temporal test, nor does it make the step's means NaN."""
    nan = math.nan
    c = tgrpo.temporal_counters([1.0, nan, 0.2], [0.5, nan, 0.5], 0.8)
    assert c == pytest.approx({"tgrpo/pass_frac": 1 / 2, "tgrpo/ordered_acc": 0.6, "tgrpo/shuffled_acc": 0.5})
    assert tgrpo.temporal_counters([nan], [nan], 0.8) == {}


def test_tgrpo_and_its_reward_must_agree(tmp_path):
    on = video_config(tmp_path)
    assert tgrpo.bonus_spec(on).name == "temporal_bonus"
    with pytest.raises(ConfigError, match="tgrpo.enabled needs exactly one"):
        tgrpo.bonus_spec(replace(on, rewards=on.rewards[:2]))
    with pytest.raises(ConfigError, match="needs tgrpo.enabled"):
        tgrpo.bonus_spec(video_config(tmp_path, "tgrpo.enabled=false"))
    with pytest.raises(ConfigError, match=r"rewards.2.args.mu"):
        tgrpo.bonus_spec(video_config(tmp_path, "tgrpo.mu=1.0"))


@pytest.mark.parametrize("args, message", [
    ("{unknown_type: skip}", r"^bad value in 'rewards.2' \(temporal_bonus\): accuracy: unknown_type must be"),
    ("{default_type: essay}", r"^bad value in 'rewards.2' \(temporal_bonus\): accuracy: unknown default_type"),
])
def test_accuracy_args_the_accuracy_refuses_are_a_config_error_before_the_model_loads(tmp_path, args, message):
    """The shuffled answers' scorer is built with the policy, before the reward zoo: a value it refuses is the
    zoo's one-line error, not a traceback, and it comes before the model loads."""
    with pytest.raises(ConfigError, match=message):
        VLMPolicy(video_config(tmp_path, f"rewards.2.args.accuracy_args={args}"))


def test_null_accuracy_args_are_no_args_as_the_reward_reads_them(tmp_path):
    assert VLMPolicy(video_config(tmp_path, "rewards.2.args.accuracy_args=null")).accuracy is not None
    assert tgrpo.accuracy_reward(video_config(tmp_path, "tgrpo.enabled=false", "rewards=[{name: accuracy}]")) is None


def test_tgrpo_decoded_in_step_refuses_data_that_mixes_video_prompts_with_others():
    """Sharded weights decoded in step (ZeRO-3, or FSDP2 without gathering) need every process to sample as often;
    T-GRPO's shuffled-frame rollouts run once per video prompt, so on mixed data the processes' weight gathers
    would stop matching and the run would hang: mixed data is a config error, video-only data passes."""
    clip = VLMSample(question="q", problem_type="multiple choice", options=[], solution="A", videos=[Path("a.mp4")])
    still = VLMSample(question="q", problem_type="multiple choice", options=[], solution="A", images=[Path("a.png")])
    check_tgrpo_in_step([clip, clip])
    with pytest.raises(ConfigError, match=r"^bad value for 'tgrpo.enabled': .*gather_sharded_weights: true"):
        check_tgrpo_in_step([clip, still])

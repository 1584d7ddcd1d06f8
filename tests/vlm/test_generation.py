"""Group sampling: vision tokens suppressed, EOS / truncation, reproducibility, shared prefill == per-row prefill,
decode positions (M-RoPE) that agree with a full forward, several prompts decoded together == one by one, and synced
decoding (every process steps until all are done) with and without FSDP2-sharded weights, and sampling with the
whole weights gathered once."""

import json
from pathlib import Path

import pytest
import torch

from mmgrpo.pipelines.vlm import generation
from mmgrpo.pipelines.vlm.config import VLMGenerationConfig, VLMModelConfig
from mmgrpo.pipelines.vlm.generation import (
    PackedSteps,
    RowSteps,
    full_attention_only,
    generate_group,
    generate_group_naive,
    generate_groups,
    prefill,
    sample_tokens,
)
from mmgrpo.pipelines.vlm.logprobs import token_logprobs
from mmgrpo.pipelines.vlm.model import VLMModel
from mmgrpo.pipelines.vlm.tiny import KINDS, build_tiny_vlm

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[2]


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module", params=KINDS)
def vlm(request):
    return VLMModel(VLMModelConfig(path=f"tiny:{request.param}"))


@pytest.fixture(scope="module")
def video_prompt(vlm):
    image = torch.randint(0, 256, (3, 56, 84), dtype=torch.uint8, generator=seeded(0))
    video = torch.randint(0, 256, (6, 3, 56, 56), dtype=torch.uint8, generator=seeded(1))
    return vlm.prompt_inputs("What happens after the flash?", [image], [video], [2.0])


def test_vision_tokens_are_never_sampled_and_suppression_is_why(vlm, video_prompt):
    cfg = VLMGenerationConfig(max_new_tokens=24, temperature=3.0)
    vision = torch.tensor(vlm.vision_token_ids)
    out = generate_group(vlm, video_prompt, 16, cfg, seeded(3))
    assert not torch.isin(out.ids[out.mask], vision).any()
    assert out.ids.max() < vlm.vocab_size  # embedding rows past the tokenizer are never sampled either
    saved = vlm.vision_token_ids
    vlm.vision_token_ids = []
    try:
        unsuppressed = generate_group(vlm, video_prompt, 16, cfg, seeded(3))
    finally:
        vlm.vision_token_ids = saved
    assert int(torch.isin(unsuppressed.ids[unsuppressed.mask], vision).sum()) > 0


def test_eos_stops_rows_and_truncation_is_flagged(vlm, video_prompt):
    limit = 40
    out = generate_group(vlm, video_prompt, 16, VLMGenerationConfig(max_new_tokens=limit), seeded(5))
    eos = torch.tensor(vlm.eos_token_ids)
    lengths = out.mask.sum(1)
    assert out.ids.dtype == torch.int64 and out.mask.dtype == torch.bool and out.truncated.shape == (16,)
    assert out.ids.shape[1] == int(lengths.max()) <= limit
    assert 0 < int(out.truncated.sum()) < 16  # this seed gives both kinds of rows
    for row, n, cut in zip(out.ids, lengths.tolist(), out.truncated.tolist()):
        real = row[:n]
        assert not torch.isin(real[:-1], eos).any()  # nothing after an EOS
        assert cut == (not bool(torch.isin(real[-1:], eos).any()))
        if cut:
            assert n == limit
        assert (row[n:] == vlm.pad_token_id).all()
    assert all(isinstance(t, str) and "<|" not in t for t in out.texts)


def test_texts_are_decoded_without_special_tokens(vlm, video_prompt):
    out = generate_group(vlm, video_prompt, 4, VLMGenerationConfig(max_new_tokens=8), seeded(0))
    assert len(out.texts) == 4
    for row, n, text in zip(out.ids, out.mask.sum(1).tolist(), out.texts):
        assert text == vlm.tokenizer.decode(row[:n], skip_special_tokens=True)
        assert not any(token in text for token in vlm.tokenizer.all_special_tokens)


def test_sampling_is_reproducible_with_a_seeded_generator(vlm, video_prompt):
    cfg = VLMGenerationConfig(max_new_tokens=12, top_p=0.9, top_k=50)
    a = generate_group(vlm, video_prompt, 4, cfg, seeded(11))
    b = generate_group(vlm, video_prompt, 4, cfg, seeded(11))
    c = generate_group(vlm, video_prompt, 4, cfg, seeded(12))
    assert torch.equal(a.ids, b.ids) and torch.equal(a.mask, b.mask) and a.texts == b.texts
    assert not torch.equal(a.ids, c.ids)


def test_shared_prefill_equals_per_row_prefill(vlm, video_prompt):
    """The group's prompt runs once and its keys and values are stored once (one packed cache row, with room for
    the 4 samples' tokens), and they equal what 4 prefilled copies hold: the same next-token logits, positions
    and samples."""
    prompt_length = video_prompt["input_ids"].shape[1]
    with torch.no_grad():
        shared, packed = prefill(vlm, [video_prompt], 4, True, 8)
        naive, rows = prefill(vlm, [video_prompt], 4, False, 8)
    assert isinstance(packed, PackedSteps) and isinstance(rows, RowSteps)
    assert torch.equal(packed.position.expand_as(rows.position), rows.position)
    diff = (shared.log_softmax(-1) - naive.log_softmax(-1)).abs().max()
    assert diff < 1e-5
    for a, b in zip(packed.cache.layers, rows.cache.layers):
        assert a.key_buffer.shape[:3] == (1, b.keys.shape[1], prompt_length + 4 * 8)
        assert b.key_buffer.shape[:3] == (4, b.keys.shape[1], prompt_length + 8)
        assert (a.keys - b.keys).abs().max() < 1e-5 and (a.values - b.values).abs().max() < 1e-5
    cfg = VLMGenerationConfig(max_new_tokens=16)
    a = generate_group(vlm, video_prompt, 4, cfg, seeded(2))
    b = generate_group_naive(vlm, video_prompt, 4, cfg, seeded(2))
    assert torch.equal(a.ids, b.ids)
    assert (a.logprobs - b.logprobs).abs().max() < 1e-5


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_decode_positions_match_the_full_forward(vlm, video_prompt, temperature):
    """Incremental decoding (M-RoPE positions continued from the prompt) scores the sampled tokens like one
    forward of [prompt; completion], at the sampling temperature; a wrong position would show up as a large
    difference."""
    cfg = VLMGenerationConfig(max_new_tokens=16, temperature=temperature)
    out = generate_group(vlm, video_prompt, 3, cfg, seeded(4))
    index = torch.zeros(3, dtype=torch.long)
    with torch.no_grad():
        full = token_logprobs(vlm.model, [video_prompt], out.ids, out.mask, index, False, temperature)
        at_one = token_logprobs(vlm.model, [video_prompt], out.ids, out.mask, index, False)
    assert (full - out.logprobs).abs().max() < 1e-4
    assert (out.logprobs[~out.mask] == 0).all()
    if temperature != 1.0:  # the same tokens scored at temperature 1 are another distribution
        assert (at_one - out.logprobs).abs().max() > 1e-2


def test_sampling_in_train_mode_with_gradient_checkpointing(vlm, video_prompt):
    checkpointed = VLMModel(VLMModelConfig(path=vlm.cfg.path, gradient_checkpointing=True))
    checkpointed.model.train()
    cfg = VLMGenerationConfig(max_new_tokens=10)
    out = generate_group(checkpointed, video_prompt, 3, cfg, seeded(6))
    assert checkpointed.model.training  # mode restored
    assert torch.equal(out.ids, generate_group(vlm, video_prompt, 3, cfg, seeded(6)).ids)


def test_sample_tokens_filters():
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0, 2.5]]).expand(400, -1)
    suppress = torch.tensor([1])
    greedy = sample_tokens(logits, suppress, VLMGenerationConfig(temperature=0.0), None)
    assert (greedy == 4).all()
    top2 = sample_tokens(logits, suppress, VLMGenerationConfig(top_k=2), seeded(0))
    assert set(top2.tolist()) == {2, 4}
    nucleus = sample_tokens(logits, suppress, VLMGenerationConfig(top_p=0.5), seeded(0))
    assert set(nucleus.tolist()) == {4}  # p(4) = 0.52 of the mass left after suppressing id 1
    free = sample_tokens(logits, torch.tensor([], dtype=torch.long), VLMGenerationConfig(temperature=2.0), seeded(0))
    assert set(free.tolist()) == {0, 1, 2, 3, 4}


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_tokens_are_drawn_from_the_softmax_at_the_temperature(temperature):
    """The draw is from softmax(logits / T), the distribution the log-probs are taken at: of two tokens whose logits
    differ by 1, the second is drawn with probability sigmoid(1 / T) (0.88 at 0.5, 0.62 at 2; 0.73 at T = 1)."""
    n = 20000
    drawn = sample_tokens(torch.tensor([[0.0, 1.0]]).expand(n, -1), torch.tensor([], dtype=torch.long),
                          VLMGenerationConfig(temperature=temperature), seeded(0))
    p = torch.sigmoid(torch.tensor(1 / temperature)).item()
    assert abs(drawn.double().mean().item() - p) < 5 * (p * (1 - p) / n) ** 0.5


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logits_are_a_clear_error_not_a_token(temperature, bad):
    """Logits that overflowed (a float16 model) or hold NaN: greedy decoding would pick the NaN or inf entry as
    its token and sampling would fail inside torch.multinomial; either stops with one line naming the rows."""
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0], [0.0, 1.0, 2.0, 3.0], [1.0, 0.0, 0.0, 0.0]])
    logits[1, 0] = bad
    cfg = VLMGenerationConfig(temperature=temperature)
    with pytest.raises(FloatingPointError, match=r"not finite in 1 of 3 rows \(row 1\).*model\.dtype") as err:
        sample_tokens(logits, torch.tensor([], dtype=torch.long), cfg, seeded(0))
    assert "\n" not in str(err.value)


@pytest.fixture(scope="module")
def prompts(vlm, video_prompt):
    """Three prompts of different lengths (so the batch is left-padded): video + image, image, text only."""
    image = torch.randint(0, 256, (3, 28, 56), dtype=torch.uint8, generator=seeded(2))
    return [video_prompt, vlm.prompt_inputs("Which colour is it?", [image], [], []),
            vlm.prompt_inputs("Count to three, slowly and carefully.", [], [], [])]


@pytest.mark.parametrize("order", ["longest first", "shortest first"])
def test_groups_decoded_together_equal_groups_decoded_alone(vlm, prompts, order):
    """The stacked cache left-pads every prompt shorter than the longest, wherever it sits in the batch (the
    first prompt's cache object holds the merged layers, so its own length must be read before the merge)."""
    prompts = prompts if order == "longest first" else prompts[::-1]
    lengths = [p["input_ids"].shape[1] for p in prompts]
    assert len(set(lengths)) == 3 and (lengths[0] == max(lengths)) == (order == "longest first")
    greedy = VLMGenerationConfig(max_new_tokens=12, temperature=0.0)
    alone = [generate_group(vlm, p, 3, greedy) for p in prompts]
    for batch_rows in (9, 6):  # all three groups in one batch; two and one
        together = generate_groups(vlm, prompts, 3, VLMGenerationConfig(max_new_tokens=12, temperature=0.0,
                                                                         batch_rows=batch_rows))
        for a, b in zip(alone, together):
            assert torch.equal(a.ids, b.ids) and torch.equal(a.mask, b.mask) and a.texts == b.texts
            assert torch.equal(a.truncated, b.truncated) and (a.logprobs - b.logprobs).abs().max() < 1e-5


def test_sliding_window_layers_prefill_one_prompt_at_a_time(tmp_path):
    """Left padding needs full-attention caches: with sliding-window layers the prompts are prefilled one at a
    time, and prefilling prompts of different lengths together is refused."""
    folder = build_tiny_vlm("qwen2_vl", tmp_path / "sliding")
    config = json.loads((folder / "config.json").read_text())
    text = config.setdefault("text_config", {})
    text.update(use_sliding_window=True, sliding_window=16, max_window_layers=1, layer_types=None)
    (folder / "config.json").write_text(json.dumps(config))
    sliding = VLMModel(VLMModelConfig(path=str(folder)))
    assert not full_attention_only(sliding)
    inputs = [sliding.prompt_inputs("Which colour is it?", [], [], []),
              sliding.prompt_inputs("Count to three, slowly.", [], [], [])]
    assert inputs[0]["input_ids"].shape[1] != inputs[1]["input_ids"].shape[1]
    with torch.no_grad():
        _, steps = prefill(sliding, inputs[:1], 2, True, 4)
    assert isinstance(steps, RowSteps)  # a packed cache row would break the window: the cache is repeated per row
    assert {type(layer).__name__ for layer in steps.cache.layers} == {"BufferLayer", "DynamicSlidingWindowLayer"}
    with pytest.raises(ValueError, match="sliding-window"), torch.no_grad():
        prefill(sliding, inputs, 2, True, 4)
    greedy = VLMGenerationConfig(max_new_tokens=6, temperature=0.0, batch_rows=8)
    together = generate_groups(sliding, inputs, 2, greedy)
    for p, out in zip(inputs, together):
        assert torch.equal(out.ids, generate_group(sliding, p, 2, greedy).ids)


@pytest.mark.parametrize("order", ["longest first", "shortest first"])
def test_sampled_groups_decoded_together_score_like_the_full_forward(vlm, prompts, order):
    """Every row's positions and padding mask are right: its tokens score as in one forward of [its prompt;
    its completion]."""
    prompts = prompts if order == "longest first" else prompts[::-1]
    cfg = VLMGenerationConfig(max_new_tokens=12, batch_rows=12)
    outs = generate_groups(vlm, prompts, 4, cfg, seeded(9))
    assert len(outs) == 3 and all(len(o.texts) == 4 for o in outs)
    for p, out in zip(prompts, outs):
        index = torch.zeros(4, dtype=torch.long)
        with torch.no_grad():
            full = token_logprobs(vlm.model, [p], out.ids, out.mask, index, False)
        assert (full - out.logprobs).abs().max() < 1e-4
        assert out.mask[:, -1].any()  # trimmed to the group's own longest completion


def test_synced_decoding_runs_every_forward_and_samples_the_same():
    """``synced``: while another process still decodes (here: always), finished rows stay in the batch and every
    token step still calls the model, and the samples are those of decoding alone, token for token. On the shipped
    tiny Qwen2-VL, whose answers end long before the token limit."""
    vlm = VLMModel(VLMModelConfig(path=str(ROOT / "assets" / "tiny-qwen2vl-shapes")))
    image = torch.randint(0, 256, (3, 56, 56), dtype=torch.uint8, generator=seeded(0))
    video = torch.randint(0, 256, (4, 3, 56, 56), dtype=torch.uint8, generator=seeded(1))
    prompts = [vlm.prompt_inputs("How many shapes are in the image?", [image], [], []),
               vlm.prompt_inputs("Which way does the shape move?", [], [video], [2.0])]
    calls = []
    hook = vlm.model.register_forward_hook(lambda *args: calls.append(1))
    try:
        for temperature in (0.0, 1.5):
            cfg = VLMGenerationConfig(max_new_tokens=24, temperature=temperature, batch_rows=8)
            calls.clear()
            alone = generate_groups(vlm, prompts, 4, cfg, seeded(7))
            needed = len(calls)
            calls.clear()
            synced = generate_groups(vlm, prompts, 4, cfg, seeded(7), synced=lambda more: True)
            assert len(calls) == 1 + cfg.max_new_tokens - 1  # one prefill of both prompts, one call per token step
            assert needed < len(calls)  # these rows end early on their own
            for a, b in zip(alone, synced):
                assert torch.equal(a.ids, b.ids) and torch.equal(a.mask, b.mask) and a.texts == b.texts
                assert torch.equal(a.truncated, b.truncated) and (a.logprobs - b.logprobs).abs().max() < 1e-5
    finally:
        hook.remove()


def test_synced_decoding_with_a_generator_per_row_outlives_its_rows():
    """One generator per row (seeded ``mmgrpo sample``), decoding in step: once every row of this process has
    ended while another process decodes on, steps sample nothing, and the samples are those of decoding alone."""
    vlm = VLMModel(VLMModelConfig(path=str(ROOT / "assets" / "tiny-qwen2vl-shapes")))
    image = torch.randint(0, 256, (3, 56, 56), dtype=torch.uint8, generator=seeded(0))
    prompts = [vlm.prompt_inputs("How many shapes are in the image?", [image], [], [])]
    cfg = VLMGenerationConfig(max_new_tokens=24, temperature=1.5)
    alone = generate_groups(vlm, prompts, 2, cfg, [seeded(1), seeded(2)])[0]
    assert int(alone.mask.sum(1).max()) < cfg.max_new_tokens  # ends before the limit: later steps have no rows
    synced = generate_groups(vlm, prompts, 2, cfg, [seeded(1), seeded(2)], synced=lambda more: True)[0]
    assert torch.equal(alone.ids, synced.ids) and alone.texts == synced.texts


def test_packed_groups_sample_what_rows_of_their_own_sample(monkeypatch):
    """Rows that end at different steps: in a packed group an ended sample stays in its block, fed padding, until
    the whole group ends. The samples (seeded, temperature 1) of several left-padded prompts decoded together
    equal those of one cache row per sample, and a group leaves the batch only once all its samples ended. On
    the shipped tiny Qwen2-VL, whose answers end long before the token limit."""
    vlm = VLMModel(VLMModelConfig(path=str(ROOT / "assets" / "tiny-qwen2vl-shapes")))
    image = torch.randint(0, 256, (3, 56, 56), dtype=torch.uint8, generator=seeded(0))
    video = torch.randint(0, 256, (4, 3, 56, 56), dtype=torch.uint8, generator=seeded(1))
    inputs = [vlm.prompt_inputs("How many shapes are in the image?", [image], [], []),
              vlm.prompt_inputs("Which way does the shape move?", [], [video], [2.0]),
              vlm.prompt_inputs("What colour is the square?", [image], [], [])]
    cfg = VLMGenerationConfig(max_new_tokens=24, temperature=1.5, batch_rows=24)
    forwards = []
    hook = vlm.model.register_forward_pre_hook(lambda _, args, kwargs: forwards.append(kwargs["input_ids"].shape),
                                               with_kwargs=True)
    try:
        packed = generate_groups(vlm, inputs, 8, cfg, seeded(3))
        packed_forwards = list(forwards)
        monkeypatch.setattr(generation, "takes_block_mask", lambda _: False)
        forwards.clear()
        rows = generate_groups(vlm, inputs, 8, cfg, seeded(3))
    finally:
        hook.remove()
    lengths = torch.cat([out.mask.sum(1) for out in packed])
    assert len(set(lengths.tolist())) > 2 and not torch.cat([out.truncated for out in packed]).all()
    for a, b in zip(packed, rows):
        assert torch.equal(a.ids, b.ids) and torch.equal(a.mask, b.mask) and a.texts == b.texts
        assert torch.equal(a.truncated, b.truncated) and (a.logprobs - b.logprobs).abs().max() < 1e-5
    assert all(shape[1] == 8 for shape in packed_forwards[1:])  # every step feeds whole groups of 8 tokens
    ended = [int(out.mask.sum(1).max()) for out in packed]  # the step each group's last sample ended at
    assert [shape[0] for shape in packed_forwards[1:]] == [sum(t < n for n in ended) for t in range(1, max(ended))]
    assert all(shape[1] == 1 for shape in forwards[1:])  # one token per row


def test_sampling_with_fsdp2_sharded_weights_on_two_processes(launch_two_processes):
    """The shipped tiny Qwen2-VL sharded with FSDP2 over two gloo processes (tests/support/fsdp_generation_check.py),
    each sampling other questions, so the processes' rows end at different steps.

    Sharded, both make the same model calls (synced decoding; else the weight gathers mismatch and the run dies)
    and sample what the whole, unsharded model samples. With the whole weights gathered once (whole_weights) the
    forwards make no collective calls: unsynced, each process makes only the calls its own rows need, and samples
    what the unsharded model samples alone. Afterwards the weights are sharded again, the policy's gathering
    evaluation answers as the unsharded policy does, a T-GRPO rollout runs shuffled-frame sampling on one process
    only, and a training step's gradients equal the unsharded model's."""
    report = launch_two_processes("fsdp_generation_check.py")
    first, second = report["processes"]
    assert report["sharded"]
    assert first["forwards_alone"] != second["forwards_alone"]  # without syncing, the calls would differ
    assert first["forwards"] == second["forwards"] == max(first["forwards_alone"], second["forwards_alone"])
    for process in (first, second):
        assert process["same_as_unsharded"]
        assert process["whole_inside"] and process["sharded_after"]
        assert process["forwards_whole"] == process["forwards_alone"] and process["whole_same_as_alone"]
        assert process["policy_eval_same"]
        assert process["grad_max_diff"] <= 1e-6
    assert (first["tgrpo_video_groups"], second["tgrpo_video_groups"]) == (1, 0)

"""token_logprobs: the Prefix Grouper equals the standard forward in log-probs and gradients, both agree with a
plain transformers forward, and both use the pixels."""

import math

import pytest
import torch

from mmgrpo.pipelines.vlm import bench, logprobs, mrope
from mmgrpo.pipelines.vlm.config import VLMModelConfig
from mmgrpo.pipelines.vlm.logprobs import token_entropy, token_logprobs, token_logprobs_and_entropy
from mmgrpo.pipelines.vlm.model import VLMModel
from mmgrpo.pipelines.vlm.tiny import KINDS

TOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_batch(vlm: VLMModel):
    """Two prompts (an image; an image + a video) x 3 completions of different lengths, rows interleaved."""
    image = torch.randint(0, 256, (3, 56, 84), dtype=torch.uint8, generator=seeded(0))
    video = torch.randint(0, 256, (6, 3, 56, 56), dtype=torch.uint8, generator=seeded(1))
    prompts = [vlm.prompt_inputs("How many cubes?", [image], []),
               vlm.prompt_inputs("What moves first?", [image], [video], [2.0])]
    lengths = torch.tensor([9, 4, 1, 12, 7, 12])
    ids = torch.randint(0, 256, (6, 12), generator=seeded(2))
    mask = torch.arange(12) < lengths[:, None]
    ids[~mask] = vlm.pad_token_id
    index = torch.tensor([1, 0, 0, 1, 0, 1])
    return prompts, ids, mask, index


def logprobs_and_grads(vlm, prompts, ids, mask, index, grouper: bool):
    model = vlm.model
    model.zero_grad(set_to_none=True)
    logp = token_logprobs(model, prompts, ids, mask, index, grouper)
    weights = torch.linspace(0.5, 1.5, ids.shape[1])  # a token-mean loss that weighs every token differently
    ((logp * weights).sum() / mask.sum()).backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module", params=KINDS)
def vlm(request):
    return VLMModel(VLMModelConfig(path=f"tiny:{request.param}", freeze_vision=False))


def test_prefix_grouper_equals_standard_in_logprobs_and_gradients(vlm):
    prompts, ids, mask, index = make_batch(vlm)
    lp_std, g_std = logprobs_and_grads(vlm, prompts, ids, mask, index, False)
    lp_pg, g_pg = logprobs_and_grads(vlm, prompts, ids, mask, index, True)
    assert lp_std.dtype == torch.float32 and lp_std.shape == (6, 12)
    assert (lp_std[~mask] == 0).all() and (lp_pg[~mask] == 0).all()
    assert (lp_std[mask] < 0).all()
    assert (lp_std - lp_pg).abs().max() <= TOL
    assert g_std.keys() == g_pg.keys()
    assert any(".visual." in n for n in g_std)  # gradients reach the vision tower through both paths
    for name in g_std:
        assert (g_std[name] - g_pg[name]).abs().max() <= TOL, name


def plain_logits(vlm: VLMModel, prompt: dict, completion: torch.Tensor) -> torch.Tensor:
    """(n, V) fp32 logits predicting each of the n ``completion`` tokens, from ``model(**processor inputs of
    [prompt; completion])`` with the positions of the whole sequence: Qwen2-VL / Qwen2.5-VL's original rule
    (:func:`mrope.config_positions`, which transformers 5.x's get_rope_index does not follow after a video),
    transformers' own for other models."""
    full = {k: v for k, v in prompt.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
    full["input_ids"] = torch.cat([prompt["input_ids"], completion[None]], dim=1)
    full["mm_token_type_ids"] = torch.cat([prompt["mm_token_type_ids"],
                                           torch.zeros(1, len(completion), dtype=torch.long)], dim=1)
    if mrope.uses_original_rule(vlm.model.config):
        full["position_ids"] = mrope.config_positions(vlm.model.config, full)
    return vlm.model(**full).logits[0, -len(completion) - 1:-1].float()


def test_standard_forward_matches_a_plain_transformers_forward(vlm):
    """Each row equals ``model(**processor inputs of [prompt; completion])`` with the whole sequence's positions
    (the prompt with a video is one where Qwen2-VL's original rule and transformers 5.x's differ)."""
    prompts, ids, mask, index = make_batch(vlm)
    with torch.no_grad():
        ours = token_logprobs(vlm.model, prompts, ids, mask, index, False)
        for row in (0, 2, 4):
            n = int(mask[row].sum())
            logits = plain_logits(vlm, prompts[index[row]], ids[row, :n])
            plain = logits.log_softmax(-1).gather(-1, ids[row, :n, None])[:, 0]
            assert (plain - ours[row, :n]).abs().max() <= TOL


@pytest.mark.parametrize("grouper", [False, True])
def test_entropy_is_that_of_the_sampling_distribution_of_a_plain_forward(vlm, grouper):
    """The entropy of softmax(logits / T) at each completion token equals torch's Categorical entropy of a plain
    transformers forward; it comes without grad from the forward that gives the log-probs."""
    prompts, ids, mask, index = make_batch(vlm)
    temperature = 0.7
    logp, entropy = token_logprobs_and_entropy(vlm.model, prompts, ids, mask, index, grouper, temperature)
    assert logp.requires_grad and not entropy.requires_grad and entropy.dtype == torch.float32
    assert torch.equal(logp.detach(), token_logprobs(vlm.model, prompts, ids, mask, index, grouper, temperature))
    assert (entropy[~mask] == 0).all() and (entropy[mask] > 0).all()
    with torch.no_grad():
        for row in (1, 3):
            n = int(mask[row].sum())
            logits = plain_logits(vlm, prompts[index[row]], ids[row, :n])
            expected = torch.distributions.Categorical(logits=logits / temperature).entropy()
            assert (expected - entropy[row, :n]).abs().max() <= TOL


def test_token_entropy_closed_forms_in_any_chunking(monkeypatch):
    """Uniform logits give log V, a one-hot limit 0, two equal logits among -inf ones log 2; the chunks of
    positions that bound memory do not change a value."""
    vocab = 7
    logits = torch.zeros(5, 3, vocab)
    logits[1, :, 2] = 1e4  # one token takes all the mass
    logits[2, :, :] = float("-inf")
    logits[2, :, :2] = 3.0  # two equally likely tokens
    logits[3] = torch.randn(3, vocab, generator=seeded(4))
    logits[4] = torch.randn(3, vocab, generator=seeded(5)) * 5
    whole = token_entropy(logits, temperature=0.5)
    assert whole.shape == (5, 3)
    torch.testing.assert_close(whole[0], torch.full((3,), math.log(vocab)))
    torch.testing.assert_close(whole[1], torch.zeros(3))
    torch.testing.assert_close(whole[2], torch.full((3,), math.log(2)))
    torch.testing.assert_close(whole[3:], torch.distributions.Categorical(logits=logits[3:] / 0.5).entropy())
    monkeypatch.setattr(logprobs, "ENTROPY_CHUNK", 2)
    assert torch.equal(token_entropy(logits, temperature=0.5), whole)


@pytest.mark.parametrize("grouper", [False, True])
def test_logprobs_depend_on_the_pixels(vlm, grouper):
    prompts, ids, mask, index = make_batch(vlm)
    with torch.no_grad():
        base = token_logprobs(vlm.model, prompts, ids, mask, index, grouper)
        changed = [dict(p) for p in prompts]
        changed[1]["pixel_values_videos"] = changed[1]["pixel_values_videos"].flip(0)
        moved = token_logprobs(vlm.model, changed, ids, mask, index, grouper)
    rows = index == 1
    assert (moved[rows] - base[rows]).abs().max() > 1e-3
    assert torch.equal(moved[~rows], base[~rows])
    without = [dict(p) for p in prompts]
    del without[0]["pixel_values"]
    with pytest.raises(ValueError, match="pixel_values"):
        token_logprobs(vlm.model, without, ids, mask, index, grouper)


def test_mask_must_mark_a_prefix(vlm):
    prompts, ids, mask, index = make_batch(vlm)
    holes = mask.clone()
    holes[0, 2] = False
    with pytest.raises(ValueError, match="prefix"):
        token_logprobs(vlm.model, prompts, ids, holes, index, True)


def test_lora_with_gradient_checkpointing_and_the_reference():
    vlm = VLMModel(VLMModelConfig(path="tiny:qwen2_5_vl", lora_rank=4, gradient_checkpointing=True))
    with torch.no_grad():
        for name, p in vlm.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=seeded(3))
    vlm.model.train()
    prompts, ids, mask, index = make_batch(vlm)
    lp_std, g_std = logprobs_and_grads(vlm, prompts, ids, mask, index, False)
    lp_pg, g_pg = logprobs_and_grads(vlm, prompts, ids, mask, index, True)
    assert g_std and all("lora_" in n for n in g_std)
    assert (lp_std - lp_pg).abs().max() <= TOL
    assert max((g_std[n] - g_pg[n]).abs().max() for n in g_std) <= TOL
    with torch.no_grad(), vlm.reference() as ref:
        lp_ref = token_logprobs(ref, prompts, ids, mask, index, True)
    assert (lp_ref - lp_pg).abs().max() > 1e-3


def test_bfloat16_model_gives_fp32_logprobs():
    vlm = VLMModel(VLMModelConfig(path="tiny:qwen2_vl", dtype="bfloat16"))
    prompts, ids, mask, index = make_batch(vlm)
    with torch.no_grad():
        std = token_logprobs(vlm.model, prompts, ids, mask, index, False)
        grouped = token_logprobs(vlm.model, prompts, ids, mask, index, True)
    assert std.dtype == grouped.dtype == torch.float32
    assert torch.isfinite(std).all() and (std - grouped).abs().max() < 0.1  # bf16 rounding only


def test_the_log_softmax_of_bf16_logits_is_taken_in_fp32():
    """A bf16 model's logits are upcast before the log-softmax, under autocast too: the log-probs are the fp32
    log-softmax of those very values, not a bf16 one cast afterwards, which is off by up to ~0.03 here (bf16 keeps
    8 bits of a log-prob near -10), enough to move a ratio clip of 1e-4."""
    logits = (3 * torch.randn(2, 5, 4096, generator=seeded(0))).to(torch.bfloat16)
    targets = torch.randint(0, 4096, (2, 5), generator=seeded(1))
    expected = logits.float().log_softmax(-1).gather(-1, targets[..., None])[..., 0]
    in_bf16 = logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0].float()
    assert (in_bf16 - expected).abs().max() > 1e-3
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = logprobs.gather_logprobs(logits, targets)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)


def test_bench_cell_runs_and_agrees(monkeypatch):
    monkeypatch.setattr(bench, "REPEATS", 1)
    vlm = VLMModel(VLMModelConfig(path="tiny:qwen2_vl"))
    cell = bench.train_cell(vlm, bench.bench_prompt(vlm, 256), 4)
    assert cell["max_abs_logprob_diff"] <= TOL and cell["max_abs_grad_diff"] <= TOL
    assert cell["act_mem_ratio"] > 1.5  # the prompt's activations are held once, not 4 times


def test_bench_rollout_cell_stores_the_prompt_cache_once(monkeypatch):
    """Shared: one cache row of P + G*T columns; naive: G rows of P + T each."""
    monkeypatch.setattr(bench, "REPEATS", 1)
    monkeypatch.setattr(bench, "COMPLETION", 8)
    vlm = VLMModel(VLMModelConfig(path="tiny:qwen2_vl"))
    cell = bench.rollout_cell(vlm, bench.bench_prompt(vlm, 256), 4)
    assert cell["kv_mem_ratio"] == pytest.approx(4 * (256 + 8) / (256 + 4 * 8))
    assert cell["shared_s"] > 0 and cell["naive_s"] > 0

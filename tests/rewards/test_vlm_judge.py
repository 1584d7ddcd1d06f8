"""VLM judges: parsers, presets and policies through a stub JudgeBackend (our own boundary), the OpenAI-compatible
backend against a real HTTP server on 127.0.0.1, and the local transformers backend end to end on a tiny Qwen2-VL."""

import base64
import io
import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image

from mmgrpo.config import RewardSpec
from mmgrpo.rewards import RewardBatch, RewardZoo
from mmgrpo.rewards.remote import RemoteError
from mmgrpo.rewards.vlm_judge import (
    UNIFIED_REWARD_PATTERNS,
    JudgeBackend,
    OpenAIJudge,
    TransformersJudge,
    VLMJudge,
    VLMPairwise,
    judge_frame_indices,
    judge_video_metadata,
    parse_artifacts,
    parse_choice,
    parse_score,
)


class StubJudge:
    """A JudgeBackend whose answers come from ``answer(request)``; records every request."""

    def __init__(self, answer):
        self.answer, self.requests = answer, []

    def generate(self, requests):
        self.requests += list(requests)
        return [self.answer(r) for r in requests]


def text_of(request):
    return "\n".join(p for p in request if isinstance(p, str))


def images_batch(n=4, groups=None):
    means = torch.linspace(0.1, 0.9, n)
    images = means.view(n, 1, 1, 1).expand(n, 3, 8, 8).clone()
    group = torch.tensor(groups if groups is not None else [0] * n)
    return RewardBatch(prompts=[f"prompt {int(g)}" for g in group], group=group, images=images)


# ---------------------------------------------------------------------------------------------------- parsers
def test_parse_score():
    assert parse_score("Score: 4", 1, 5) == 4.0
    assert parse_score("The image is fine.\nscore = **4.5**", 1, 5) == 4.5
    assert parse_score("Score: 2, no wait. Score: 3/5", 1, 5) == 3.0  # the last one counts
    assert parse_score(" 5. ", 1, 5) == 5.0
    assert parse_score("Score: 7", 1, 5) is None  # out of range
    assert parse_score("I like it, 4 stars", 1, 5) is None
    assert parse_score("VQ: 2\nMQ: 3\nTA: 5", 1, 5, label="MQ") == 3.0


def test_parse_choice():
    assert parse_choice("Better: A") == 1.0
    assert parse_choice("Image B has fewer artifacts.\nbetter: **B**") == 0.0
    assert parse_choice("Better: tie") == 0.5
    assert parse_choice("b.") == 0.0
    assert parse_choice("Both are good") is None
    assert parse_choice("Better: C") is None
    assert parse_choice("Better: A\n...on reflection, Better: B") == 0.0  # the conclusion comes last


@pytest.mark.parametrize(("answer", "expected"), [
    ("Image 1 is better than Image 2.", 1.0),
    ("Image 2 is better than Image 1.", 0.0),
    ("Both images are equally good.", 0.5),
    (("Image 1 shows the red cube clearly, but its lighting is flat. Image 2 follows the caption and has richer "
      "detail. Therefore, Image 2 is better than Image 1."), 0.0),
    ("<think>Image 2 is better lit, yet Image 1 matches the caption.</think>\n<answer>Image 1 is better</answer>", 1.0),
    ("**Image 2** is the better image.", 0.0),
    ("Video 1 is better than Video 2.", 1.0),
    ("Overall, image 2 is worse than image 1.", 1.0),
    ("Both images are equally bad.", 0.5),
    ("I cannot compare these images.", None),
    ("Image 1: a cube. Image 2: a ball.", None),
    ("Better: A", None),  # the other preset's format does not count here
])
def test_parse_choice_unified_reward_answers(answer, expected):
    assert parse_choice(answer, UNIFIED_REWARD_PATTERNS) == expected


def test_parse_artifacts():
    assert parse_artifacts('{"artifacts": []}') == []
    fenced = 'Here:\n```json\n{"artifacts": [{"type": "extra fingers", "severity": 2}, {"type": "blur", "severity": 1}]}\n```'
    assert parse_artifacts(fenced) == [2.0, 1.0]
    assert parse_artifacts('noise {not json} {"other": 1} {"artifacts": [{"severity": 3}]}') == [3.0]
    assert parse_artifacts('{"artifacts": [{"type": "x", "severity": 5}]}') is None
    assert parse_artifacts('{"artifacts": [{"type": "x", "severity": true}]}') is None
    assert parse_artifacts('{"artifacts": [{"type": "x"}]}') is None
    assert parse_artifacts("no artifacts at all") is None


# ---------------------------------------------------------------------------------------------------- presets
def test_score_preset_on_images_normalised_and_raw():
    answers = iter(["Score: 5", "Score: 1", "Score: 3", "gibberish"])
    stub = StubJudge(lambda r: next(answers))
    assert isinstance(stub, JudgeBackend)
    out = VLMJudge(backend=stub)(images_batch())
    assert out["score"][:3].tolist() == [1.0, 0.0, 0.5] and math.isnan(out["score"][3])
    assert out["parse_fail"].tolist() == [0.0, 0.0, 0.0, 1.0]
    request = stub.requests[0]
    assert torch.equal(request[0], images_batch().images[0])  # the tensor itself, no PIL/PNG round trip
    assert 'request: "prompt 0"' in request[1] and "from 1 (worst) to 5 (best)" in request[1]
    raw = VLMJudge(backend=StubJudge(lambda r: "Score: 7"), score_range=[0, 10], normalize=False)
    assert raw(images_batch(2))["score"].tolist() == [7.0, 7.0]


@pytest.mark.parametrize(("policy", "normalize", "expected"),
                         [("zero", True, 0.0), ("mid", True, 0.5), ("mid", False, 3.0), ("zero", False, 0.0)])
def test_parse_failure_policies(policy, normalize, expected):
    judge = VLMJudge(backend=StubJudge(lambda r: "no score here"), on_parse_fail=policy, normalize=normalize)
    out = judge(images_batch(3))
    assert out["score"].tolist() == [expected] * 3 and out["parse_fail"].tolist() == [1.0] * 3


def test_text_completions_and_custom_template():
    stub = StubJudge(lambda r: "Score: 4" if "42" in text_of(r) else "Score: 2")
    batch = RewardBatch(prompts=["what is 6*7?"] * 2, group=torch.zeros(2, dtype=torch.long),
                        completions=["42", "41"])
    judge = VLMJudge(backend=stub, template='Q: {prompt} ({subject}) rate {lo}-{hi}, answer {"score": n}')
    assert judge(batch)["score"].tolist() == [0.75, 0.25]
    assert stub.requests[0] == ['Response:\n42\n\nQ: what is 6*7? (response) rate 1-5, answer {"score": n}']


def test_prompts_are_put_into_the_template_verbatim():
    """A prompt holding a placeholder's spelling (LaTeX ``T_{hi}``, ``x_{lo}``) reaches the judge as written."""
    prompt = "is T_{hi} > T_{lo} for this {subject}?"
    stub = StubJudge(lambda r: "Score: 3")
    batch = RewardBatch(prompts=[prompt], group=torch.zeros(1, dtype=torch.long), completions=["yes"])
    VLMJudge(backend=stub, template="{prompt} | {subject} {lo}-{hi}")(batch)
    assert stub.requests[0] == [f"Response:\nyes\n\n{prompt} | response 1-5"]
    VLMPairwise(backend=stub, template="{prompt} | {Subject}")(batch.select([0, 0]))
    assert stub.requests[1][0].endswith(f"{prompt} | Response")


def test_artifacts_preset():
    answers = iter(['{"artifacts": []}', '{"artifacts": [{"type": "extra fingers", "severity": 2}]}',
                    ('```json\n{"artifacts": [{"type": "a", "severity": 3}, {"type": "b", "severity": 3}, '
                     '{"type": "c", "severity": 3}, {"type": "d", "severity": 3}]}\n```'), "sorry"])
    out = VLMJudge(preset="artifacts", backend=StubJudge(lambda r: next(answers)), on_parse_fail="zero")(
        images_batch())
    torch.testing.assert_close(out["score"], torch.tensor([1.0, 0.8, 0.0, 0.0], dtype=torch.float64))
    assert out["artifacts"][:3].tolist() == [0.0, 1.0, 4.0] and math.isnan(out["artifacts"][3])
    assert out["parse_fail"].tolist() == [0.0, 0.0, 0.0, 1.0]
    penalty = VLMJudge(preset="artifacts", artifact_penalty=0.25,
                       backend=StubJudge(lambda r: '{"artifacts": [{"type": "x", "severity": 1}]}'))
    assert penalty(images_batch(1))["score"].tolist() == [0.75]


def test_judge_frames_resample_to_the_judge_fps():
    assert judge_frame_indices(16, 8.0, 2.0, 16).tolist() == [0, 5, 10, 15]  # 2 s -> 4 frames
    assert len(judge_frame_indices(16, 16.0, 2.0, 16)) == 2  # 1 s -> 2 frames
    assert len(judge_frame_indices(16, 2.0, 2.0, 6)) == 6  # capped
    assert len(judge_frame_indices(5, 2.0, 2.0, 16)) == 4  # even count
    assert judge_frame_indices(1, 30.0, 2.0, 16).tolist() == [0, 0]  # one frame is repeated


@pytest.mark.parametrize(("total", "input_fps", "fps", "count"), [
    (16, 8.0, 1.9, 2),  # 3.8 frames -> 2 (rounding first gave 4)
    (28, 10.0, 2.0, 4),  # 5.6 -> 4 (rounding first gave 6)
    (30, 10.0, 1.7, 4),  # 5.1 -> 4
    (20, 10.0, 3.0, 6),  # 6.0 -> 6
])
def test_judge_frame_count_floors_to_even_as_qwen_vl_utils(total, input_fps, fps, count):
    """qwen-vl-utils ``smart_nframes`` (0.0.14) floors total / video_fps * fps straight to an even count."""
    assert len(judge_frame_indices(total, input_fps, fps, 16)) == count


class RecordingBackend:
    """A judge backend that answers a fixed rating and keeps the video metadata it was given."""

    def __init__(self):
        self.metadata = None

    def generate(self, requests, video_metadata=None):
        self.metadata = video_metadata
        return ["VQ: 3\nMQ: 3\nTA: 3\nBetter: A"] * len(requests)


class PlainBackend:
    """A judge backend written against the plain protocol, ``generate(requests)``."""

    def generate(self, requests):
        return ["VQ: 3\nMQ: 3\nTA: 3\nBetter: A"] * len(requests)


def test_backends_that_take_it_get_each_videos_frame_metadata_in_order():
    videos = RewardBatch(prompts=["a", "b"], group=torch.zeros(2, dtype=torch.long), videos=torch.rand(2, 16, 3, 4, 4),
                         meta=[{"fps": 8}, {"fps": 16}])
    backend = RecordingBackend()
    VLMJudge(preset="video_align", backend=backend)(videos)
    assert backend.metadata == [
        {"total_num_frames": 16, "fps": 8.0, "frames_indices": [0, 5, 10, 15], "duration": 2.0},
        {"total_num_frames": 16, "fps": 16.0, "frames_indices": [0, 15], "duration": 1.0}]
    VLMPairwise(backend=backend, both_orders=True)(videos)  # two videos per request: first, then second
    assert [m["fps"] for m in backend.metadata] == [8.0, 16.0, 16.0, 8.0]
    assert VLMJudge(preset="video_align", backend=PlainBackend())(videos)["VQ"].tolist() == [0.5, 0.5]


def test_local_backend_tells_qwen2_5_vl_the_judges_frame_rate(tmp_path):
    """Qwen2.5-VL encodes time from the frame rate in the processor's video metadata (24 fps without it)."""
    from mmgrpo.pipelines.vlm.tiny import build_tiny_vlm

    judge = TransformersJudge(str(build_tiny_vlm("qwen2_5_vl", tmp_path)), dtype="float32", max_new_tokens=2)
    indices = judge_frame_indices(16, 8.0, 2.0, 16)  # 4 frames of a 2 s clip: 2 fps
    request = [[torch.rand(16, 3, 28, 28)[indices], "rate it"]]
    inputs = judge.inputs(request, [judge_video_metadata(16, 8.0, indices)])
    temporal_patch = judge.processor.video_processor.temporal_patch_size
    assert inputs["second_per_grid_ts"].tolist() == pytest.approx([temporal_patch / 2.0])
    assert judge.inputs(request)["second_per_grid_ts"].tolist() == pytest.approx([temporal_patch / 24.0])
    assert len(judge.generate(request, [judge_video_metadata(16, 8.0, indices)])) == 1


def test_video_align_preset():
    answers = {"a cat": "VQ: 5\nMQ: 3\nTA: 1", "a dog": "VQ: 4 MQ: 4", "a fox": "vq=2, mq=2, ta=2"}
    stub = StubJudge(lambda r: answers[text_of(r).split('"')[1]])
    videos = torch.rand(3, 16, 3, 4, 4)
    batch = RewardBatch(prompts=list(answers), group=torch.arange(3), videos=videos,
                        meta=[{"fps": 8}, {}, {"fps": 16}])
    out = VLMJudge(preset="video_align", backend=stub, input_fps=4)(batch)
    assert out["VQ"].tolist()[0::2] == [1.0, 0.25] and out["TA"][0] == 0.0 and out["MQ"][2] == 0.25
    assert out["score"][0] == pytest.approx(0.5) and out["score"][2] == pytest.approx(0.25)
    assert math.isnan(out["score"][1]) and out["parse_fail"].tolist() == [0.0, 1.0, 0.0]
    # frames at 2 fps: 16 frames at 8 fps -> 4; at 4 fps (input_fps) -> 8; at 16 fps -> 2
    assert [r[0].shape[0] for r in stub.requests] == [4, 8, 2]
    with pytest.raises(ValueError, match="frame rate is unknown"):
        VLMJudge(preset="video_align", backend=stub)(batch)
    with pytest.raises(ValueError, match="video_align preset judges videos"):
        VLMJudge(preset="video_align", backend=stub)(images_batch(2))


def test_bad_arguments():
    stub = StubJudge(lambda r: "")
    with pytest.raises(ValueError, match="preset must be one of"):
        VLMJudge(preset="nope", backend=stub)
    with pytest.raises(ValueError, match="on_parse_fail"):
        VLMJudge(backend=stub, on_parse_fail="skip")
    with pytest.raises(ValueError, match="score_range"):
        VLMJudge(backend=stub, score_range=[5, 1])
    with pytest.raises(ValueError, match="backend must be one of"):
        VLMJudge(backend="vllm")
    with pytest.raises(ValueError, match="no images, videos or completions"):
        VLMJudge(backend=stub)(RewardBatch(prompts=["a"], group=torch.zeros(1, dtype=torch.long)))


# ---------------------------------------------------------------------------------------------------- pairwise
def brighter(request):
    """A judge that prefers the brighter image."""
    a, b = (p for p in request if torch.is_tensor(p))
    return "Better: A" if a.mean() > b.mean() else "Better: B"


def test_pairwise_win_rates_within_groups():
    stub = StubJudge(brighter)
    batch = images_batch(7, groups=[0, 0, 0, 0, 1, 1, 2])
    out = VLMPairwise(backend=stub)(batch)
    assert out["score"][:6].tolist() == [0.0, 1 / 3, 2 / 3, 1.0, 0.0, 1.0]
    assert math.isnan(out["score"][6]) and math.isnan(out["parse_fail"][6])  # a group of one
    assert out["parse_fail"][:6].tolist() == [0.0] * 6
    assert len(stub.requests) == 6 + 1  # C(4,2) + C(2,2): pairs never cross groups
    assert [p for p in stub.requests[0] if isinstance(p, str)][:2] == ["Image A:", "Image B:"]


def test_pairwise_unparsable_answers_are_ties():
    out = VLMPairwise(backend=StubJudge(lambda r: "hmm"))(images_batch(3))
    assert out["score"].tolist() == [0.5] * 3 and out["parse_fail"].tolist() == [1.0] * 3


def test_pairwise_unified_reward_preset_counts_unparsable_answers():
    """UnifiedReward-style answers through the preset: labels 1 / 2, its prompt, its conclusions; answers that give
    no verdict count in parse_fail and score as ties."""
    def judge(request):
        a, b = (p for p in request if torch.is_tensor(p))
        if a.mean() == b.mean():
            return "Both images look similar, I can't say."
        return ("Image 1 is sharper. Image 1 is better than Image 2." if a.mean() > b.mean()
                else "After comparing alignment and quality, Image 2 is better than Image 1.")

    stub = StubJudge(judge)
    images = torch.stack([torch.full((3, 8, 8), v) for v in (0.2, 0.8, 0.8, 0.5)])
    batch = RewardBatch(prompts=["a red cube"] * 4, group=torch.zeros(4, dtype=torch.long), images=images)
    out = VLMPairwise(preset="unified_reward", backend=stub)(batch)
    # 0.2 loses all; each 0.8 beats 0.2 and 0.5 and ties (unparsed) with the other 0.8; 0.5 beats 0.2 only
    assert out["score"].tolist() == pytest.approx([0.0, 2.5 / 3, 2.5 / 3, 1 / 3])
    assert out["parse_fail"].tolist() == pytest.approx([0.0, 1 / 3, 1 / 3, 0.0])
    first = stub.requests[0]
    assert [p for p in first if isinstance(p, str)][:2] == ["Image 1:", "Image 2:"]
    assert "Text Caption: [a red cube]" in first[-1] and '"Image 1 is better than Image 2."' in first[-1]
    custom = VLMPairwise(backend=StubJudge(lambda r: "Winner: second"),
                         answer_patterns={"A": r"winner:\s*first", "B": r"winner:\s*second"})
    assert custom(images_batch(2))["score"].tolist() == [0.0, 1.0]
    with pytest.raises(ValueError, match="answer_patterns needs the verdicts 'A' and 'B'"):
        VLMPairwise(backend=stub, answer_patterns={"A": "x", "second": "y"})
    with pytest.raises(ValueError, match=r"answer_patterns\['B'\] is not a regex"):
        VLMPairwise(backend=stub, answer_patterns={"A": "x", "B": "(unclosed"})
    with pytest.raises(ValueError, match="preset must be one of"):
        VLMPairwise(backend=stub, preset="unifiedreward")


def test_empty_batches_score_empty():
    stub = StubJudge(lambda r: "Score: 3")
    empty = RewardBatch(prompts=[], group=torch.zeros(0, dtype=torch.long), images=torch.zeros(0, 3, 8, 8))
    for judge, keys in [(VLMJudge(backend=stub), {"score", "parse_fail"}),
                        (VLMJudge(preset="artifacts", backend=stub), {"score", "artifacts", "parse_fail"}),
                        (VLMPairwise(backend=stub), {"score", "parse_fail"})]:
        out = judge(empty)
        assert set(out) == keys and all(v.shape == (0,) and v.dtype == torch.float64 for v in out.values())
    assert stub.requests == []
    main, logged, _ = RewardZoo([RewardSpec(name="mmgrpo.rewards.vlm_judge:VLMJudge", args={"backend": stub})])(empty)
    assert main.shape == (0, 1) and logged["mmgrpo.rewards.vlm_judge:VLMJudge/score"].shape == (0,)


def test_pairwise_both_orders_cancels_position_bias():
    first_always = StubJudge(lambda r: "Better: A")
    assert VLMPairwise(backend=first_always)(images_batch(3))["score"].tolist() == [1.0, 0.5, 0.0]
    both = VLMPairwise(backend=StubJudge(lambda r: "Better: A"), both_orders=True)(images_batch(3))
    assert both["score"].tolist() == [0.5] * 3
    fair = StubJudge(brighter)
    assert VLMPairwise(backend=fair, both_orders=True)(images_batch(3))["score"].tolist() == [0.0, 0.5, 1.0]
    assert len(fair.requests) == 6


def test_pairwise_on_text_through_the_zoo():
    stub = StubJudge(lambda r: "Better: A" if "Response A:\nlong answer" in r[0] else "Better: B")
    batch = RewardBatch(prompts=["q"] * 2, group=torch.zeros(2, dtype=torch.long),
                        completions=["short", "long answer"])
    zoo = RewardZoo([RewardSpec(name="mmgrpo.rewards.vlm_judge:VLMPairwise", args={"backend": stub})])
    main, logged, _ = zoo(batch)
    assert main[:, 0].tolist() == [0.0, 1.0]
    assert set(logged) == {"mmgrpo.rewards.vlm_judge:VLMPairwise/score",
                           "mmgrpo.rewards.vlm_judge:VLMPairwise/parse_fail"}


# ---------------------------------------------------------------------------------------------------- OpenAI backend
class ChatServer(ThreadingHTTPServer):
    """A canned OpenAI-compatible chat-completions server: ``statuses`` are answered first, then ``reply``."""

    daemon_threads = True

    def __init__(self, reply):
        super().__init__(("127.0.0.1", 0), ChatHandler)
        self.reply, self.statuses, self.seen = reply, [], []

    @property
    def base_url(self):
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class ChatHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append((self.path, self.headers.get("Authorization"), body))
        status = self.server.statuses.pop(0) if self.server.statuses else 200
        if status == 200:
            answer = {"id": "x", "object": "chat.completion", "model": body["model"],
                      "choices": [{"index": 0, "finish_reason": "stop",
                                   "message": {"role": "assistant", "content": self.server.reply(body)}}]}
        else:
            answer = {"error": f"status {status}"}
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def chat_server():
    def reply(body):
        text = next(p["text"] for p in body["messages"][0]["content"] if p["type"] == "text")
        return "Score: 4" if "cat" in text else "I cannot rate this."

    server = ChatServer(reply)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def decode_data_url(url):
    assert url.startswith("data:image/png;base64,")
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))


def test_openai_backend_end_to_end(chat_server, monkeypatch):
    monkeypatch.setenv("MMGRPO_TEST_JUDGE_KEY", "sk-test\n")  # read from a file: its newline is not sent
    batch = images_batch(3)
    batch.prompts = ["a cat", "a dog", "a cat"]
    judge = VLMJudge(backend="openai", on_parse_fail="zero",
                     backend_args={"base_url": chat_server.base_url, "model": "judge-7b",
                                   "api_key_env": "MMGRPO_TEST_JUDGE_KEY", "concurrency": 2, "max_tokens": 32})
    out = judge(batch)
    assert out["score"].tolist() == [0.75, 0.0, 0.75] and out["parse_fail"].tolist() == [0.0, 1.0, 0.0]
    assert len(chat_server.seen) == 3
    path, auth, body = chat_server.seen[0]
    assert path == "/v1/chat/completions" and auth == "Bearer sk-test"
    assert body["model"] == "judge-7b" and body["max_tokens"] == 32 and body["temperature"] == 0.0
    assert [p["type"] for p in body["messages"][0]["content"]] == ["image_url", "text"]
    matched = set()  # requests run concurrently: match each sent image to the batch image it came from
    for _, _, sent_body in chat_server.seen:
        sent = decode_data_url(sent_body["messages"][0]["content"][0]["image_url"]["url"])
        assert sent.size == (8, 8)
        pixels = torch.from_numpy(np.array(sent)).permute(2, 0, 1).float() / 255
        errors = (pixels - batch.images).flatten(1).abs().amax(1)
        assert errors.min() <= 0.5 / 255 + 1e-6
        matched.add(int(errors.argmin()))
    assert matched == {0, 1, 2}


def test_openai_backend_sends_video_frames_as_images(chat_server):
    batch = RewardBatch(prompts=["a cat"], group=torch.zeros(1, dtype=torch.long), videos=torch.rand(1, 8, 3, 6, 6))
    backend = OpenAIJudge(chat_server.base_url, "judge", concurrency=1)
    VLMJudge(backend=backend, input_fps=4)(batch)  # 2 s at 2 fps -> 4 frames
    content = chat_server.seen[0][2]["messages"][0]["content"]
    assert [p["type"] for p in content] == ["image_url"] * 4 + ["text"]


def test_openai_backend_retries_then_fails_in_one_line(chat_server, monkeypatch):
    chat_server.statuses = [503, 502]
    backend = OpenAIJudge(chat_server.base_url, "judge", retries=2, backoff=0.01)
    assert backend.generate([["a cat"]]) == ["Score: 4"]
    assert len(chat_server.seen) == 3
    chat_server.statuses = [400]
    with pytest.raises(RemoteError, match=f"POST {chat_server.base_url}/chat/completions failed: HTTP 400: "
                                          "status 400"):
        backend.generate([["a cat"]])
    monkeypatch.delenv("MMGRPO_TEST_MISSING_KEY", raising=False)
    with pytest.raises(ValueError, match="MMGRPO_TEST_MISSING_KEY"):
        OpenAIJudge(chat_server.base_url, "judge", api_key_env="MMGRPO_TEST_MISSING_KEY")


# ---------------------------------------------------------------------------------------------------- local backend
@pytest.fixture(scope="module")
def tiny_judge(tmp_path_factory):
    """The local backend on a tiny random Qwen2-VL checkpoint in the real format (built into a temp folder)."""
    from mmgrpo.pipelines.vlm.tiny import build_tiny_vlm

    path = build_tiny_vlm("qwen2_vl", tmp_path_factory.mktemp("tiny_qwen2_vl"))
    return TransformersJudge(str(path), dtype="float32", max_new_tokens=6, batch_size=2)


def test_local_backend_end_to_end_on_a_tiny_qwen2_vl(tiny_judge):
    vision = ["<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
    assert tiny_judge.suppress == sorted(tiny_judge.processor.tokenizer.convert_tokens_to_ids(vision))
    judge = VLMJudge(backend=tiny_judge, on_parse_fail="mid")
    batch = images_batch(3)  # 3 requests in generate batches of 2
    out = judge(batch)
    assert set(out) == {"score", "parse_fail"}
    # a random model answers garbage: whatever it says, an unparsable answer scores the middle of the range
    assert torch.where(out["parse_fail"] == 1, out["score"] == 0.5, out["score"] >= 0).all()
    requests = [[img, f"rate {i}"] for i, img in enumerate(batch.images)] + [["Response:\nhi\n\nrate it"]]
    batched = tiny_judge.generate(requests)
    tiny_judge.batch_size = 1
    try:
        assert tiny_judge.generate(requests) == batched  # left padding: batching does not change greedy answers
    finally:
        tiny_judge.batch_size = 2
    videos = RewardBatch(prompts=["a cat", "a dog"], group=torch.arange(2), videos=torch.rand(2, 6, 3, 28, 28),
                         meta=[{"fps": 4}] * 2)
    video_out = VLMJudge(preset="video_align", backend=tiny_judge, on_parse_fail="zero")(videos)
    assert set(video_out) == {"VQ", "MQ", "TA", "score", "parse_fail"}
    pairwise = VLMPairwise(backend=tiny_judge)(images_batch(3))
    assert pairwise["score"].sum().item() == pytest.approx(1.5)  # win rates of a group of 3 always sum to 3/2

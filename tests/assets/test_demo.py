"""`mmgrpo demo` end to end on the shipped tiny models (flow: ShapesT2I; vlm: ShapesQA + MotionQA), shrunk to one
training step."""

import dataclasses
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from small_demo import SMALL, shrink

from mmgrpo import demo
from mmgrpo.config import RewardSpec
from mmgrpo.pipelines.vlm.data import read_samples, render_prompt, reward_meta
from mmgrpo.rewards import RewardBatch
from mmgrpo.rewards.zoo import RewardZoo

SUPPORT = Path(__file__).resolve().parents[1] / "support"



@pytest.fixture
def small_demo(monkeypatch):
    threads = torch.get_num_threads()
    for which in ("flow", "vlm"):
        monkeypatch.setitem(demo.DEMOS, which, shrink(which))
    yield
    torch.set_num_threads(threads)


def test_flow_demo_trains_the_shipped_model_and_reports(small_demo, tmp_path, monkeypatch):
    result, stopped_by = demo.run_demo("flow", str(tmp_path), minutes=0.0)  # the budget ends after the first step
    saved = json.loads((tmp_path / "demo.json").read_text())
    assert stopped_by is None
    assert saved == result and set(saved) == {"task", "metric", "before", "after", "minutes"}
    assert saved["metric"] == "shapes_eval/score" and 0 <= saved["before"] <= 1 and 0 <= saved["after"] <= 1
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["ratio/onpolicy_max_dev"] <= 1e-6
    logged = {f"reward/{name}/mean" for name in ("shapes_eval/score", "shapes_partial", "shapes_layout")}
    assert logged <= set(rows[0])
    report = (tmp_path / "report.md").read_text()
    for name in ("reward_curve.png", "samples_before.png", "samples_after.png"):
        assert f"({name})" in report and (tmp_path / name).stat().st_size > 1000
    for measure in ("shapes_eval/score", "diversity", "size_position_distance"):
        assert f"| {measure} |" in report
    assert "scored only before and after training" in report

    # the report's snippet loads the reported weights (marked here) into the stock pipeline and generates
    file = tmp_path / "reported-policy" / "transformer" / "diffusion_pytorch_model.safetensors"
    marked = load_file(file)
    name = next(iter(marked))
    marked[name] += 1.0
    save_file(marked, file)
    monkeypatch.chdir(tmp_path)  # the snippet saves sample.png
    scope = {}
    exec(report_code(tmp_path), scope)  # noqa: S102 - the report's own snippet, run as a user would
    assert scope["image"].size == (64, 64) and (tmp_path / "sample.png").is_file()
    torch.testing.assert_close(scope["pipe"].transformer.state_dict()[name], marked[name])

    # it is a whole pipeline folder, so `mmgrpo sample` (the command report.md names) loads it as model.path
    weights = tmp_path / "reported-policy"
    assert f"`mmgrpo sample {demo.DEMOS['flow'].preset} model.path={weights}`" in report
    monkeypatch.chdir(demo.REPO)
    from mmgrpo.cli import main
    from mmgrpo.config import load_config
    from mmgrpo.policy import build_policy

    args = [demo.DEMOS["flow"].preset, f"model.path={weights}", f"output_dir={tmp_path / 'sampled'}", *SMALL]
    assert main(["sample", *args, "--num", "1"]) == 0
    assert (tmp_path / "sampled" / "samples" / "sample-base.png").is_file()
    policy = build_policy(load_config(args[0], args[1:]))  # the weights `mmgrpo sample` drew with
    torch.testing.assert_close(policy.adapter.transformer.state_dict()[name], marked[name])


def test_the_step_training_ends_on_is_validated_between_two_checks(tmp_path, monkeypatch, capsys):
    """train.max_steps that is not a multiple of eval_every: the last steps are validated too, so they can be
    reported (they were trained and never considered)."""
    spec = dataclasses.replace(shrink("flow"), eval_every=2, overrides=[*SMALL, "train.max_steps=3"])
    monkeypatch.setitem(demo.DEMOS, "flow", spec)
    threads = torch.get_num_threads()
    try:
        demo.run_demo("flow", str(tmp_path), minutes=60.0)
    finally:
        torch.set_num_threads(threads)
    printed = "".join(capsys.readouterr())
    assert re.findall(r"step (\d+): validation", printed) == ["2", "3"]
    assert "| training | 3 optimiser steps: step budget reached |" in (tmp_path / "report.md").read_text()


def snippet(markdown: str) -> str:
    """The Python snippet of a "The reported model" section (:func:`demo.reported_model_usage`)."""
    found = re.search(r"## The reported model\n.*?```python\n(.*?)```", markdown, re.DOTALL)
    assert found, "no snippet for the reported model"
    return found.group(1)


def report_code(out: Path) -> str:
    """The Python snippet of report.md."""
    return snippet((out / "report.md").read_text())


@pytest.mark.parametrize("which", ["flow", "vlm"])
def test_the_reports_snippet_loads_a_reported_lora(which, tmp_path, monkeypatch):
    """The demo presets train every weight; with ``model.lora_rank`` set, the snippet loads the adapter instead."""
    from mmgrpo.config import load_config
    from mmgrpo.policy import build_policy

    spec = demo.DEMOS[which]
    cfg = load_config(demo.REPO / spec.preset, [f"output_dir={tmp_path / 'run'}", "model.lora_rank=4", *SMALL])
    policy = build_policy(cfg)
    lora = [p for n, p in policy.model.named_parameters() if "lora_B" in n]
    with torch.no_grad():  # LoRA B starts at zero: random values make every loaded tensor tell
        for i, p in enumerate(lora):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    weights = tmp_path / "reported-policy"
    policy.save(weights)
    code = demo.reported_model_usage(which, spec, cfg, weights, "a red circle",
                                     policy.adapter if which == "flow" else None)
    monkeypatch.chdir(tmp_path)  # the flow snippet saves sample.png
    scope = {}
    exec(snippet(code), scope)  # noqa: S102 - the report's snippet, run as a user would
    loaded = scope["pipe"].transformer if which == "flow" else scope["model"]
    got = sorted(round(p.sum().item(), 4) for n, p in loaded.named_parameters() if "lora_B" in n)
    assert got == sorted(round(p.sum().item(), 4) for p in lora) and len(got) > 0


def before_columns(out: Path) -> dict[str, str]:
    """The "before" column of the report's table and of samples.md: {measure or prompt: value as written}."""
    rows = [line.strip().strip("|").split(" | ") for name in ("report.md", "samples.md")
            for line in (out / name).read_text().splitlines() if line.startswith("| ")]
    return {cells[0].strip(): cells[1].strip() for cells in rows if len(cells) >= 3}


def test_vlm_demo_trains_the_shipped_model_and_reports(small_demo, tmp_path, support_env, monkeypatch):
    """The demo in one process, then as ``mmgrpo demo vlm`` runs it by default on a 2-core CPU: two gloo DDP
    processes that train together and split every evaluation. Split and gathered, the evaluation of the base
    model is the one-process evaluation, measure for measure and answer for answer."""
    out = tmp_path / "one"
    result, _ = demo.run_demo("vlm", str(out), minutes=0.0)
    saved = json.loads((out / "demo.json").read_text())
    assert saved == result and saved["metric"] == "accuracy" and 0 <= saved["after"] <= 1
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["ratio/onpolicy_max_dev"] <= 1e-6
    assert {"reward/accuracy/mean", "reward/format/mean"} <= set(rows[0])
    report = (out / "report.md").read_text()
    assert "| accuracy |" in report and (out / "reward_curve.png").stat().st_size > 1000
    assert "| answer_diversity |" in report and "`answer_diversity`" in report
    assert "| circular_accuracy |" in report
    for kind in ("colour", "shape", "count"):  # the first 3 held-out questions, one per image kind
        assert f"| accuracy/shapes_qa/{kind} |" in report
    for kind in ("colour", "shape"):  # the multiple-choice ones
        assert f"| answer_diversity/shapes_qa/{kind} |" in report
    assert (out / "samples.md").read_text().count("<answer>") >= 2  # before and after completions
    png = (out / "samples.png").read_bytes()  # the media, questions and answers of the 3 held-out questions
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000
    assert "![before/after samples](samples.png)" in report and "[samples.md](samples.md)" in report
    assert "| validation | 2 unseen prompts from assets/data/shapes_qa/val.jsonl, every " in report
    assert "| training | 1 optimiser step: time budget of 0.0 minutes reached at step 1 |" in report
    file = out / "reported-policy" / "model.safetensors"  # the snippet loads these weights (marked here)
    marked = load_file(file)
    name = next(iter(marked))
    marked[name] += 1.0
    save_file(marked, file, metadata={"format": "pt"})
    scope = {}
    exec(report_code(out), scope)  # noqa: S102 - the report's own snippet, run as a user would
    torch.testing.assert_close(scope["model"].state_dict()[name], marked[name])
    assert scope["processor"].tokenizer is not None

    monkeypatch.setenv("PYTHONPATH", support_env["PYTHONPATH"])  # the launched processes import tests/support
    ddp = tmp_path / "ddp"
    assert demo.launch(2, [str(SUPPORT / "demo_ddp_check.py"), "vlm", str(ddp)]) == 0
    rows = [json.loads(line) for line in (ddp / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["ratio/onpolicy_max_dev"] <= 1e-6
    assert json.loads((ddp / "run" / "checkpoints" / "step-1" / "trainer_state.json").read_text())[
        "num_processes"] == 2
    assert re.search(r"\| rollouts \| 2 prompts x \d+ samples per step, split over 2 processes \(DDP\) \|",
                     (ddp / "report.md").read_text())
    one_process = before_columns(out)
    assert len(one_process) >= 3 + 8 and before_columns(ddp) == one_process


def test_ctrl_c_stops_a_two_process_demo_after_the_step_and_it_still_reports(tmp_path, support_env):
    """Ctrl-C reaches the process that launched the demo's two processes (they run in their own session), which
    passes one SIGINT to each: they finish the step, save, validate that step, evaluate and report, and the demo
    exits 130 with no traceback from torch's launcher."""
    out, log, printed = tmp_path / "demo", tmp_path / "stderr.txt", tmp_path / "stdout.txt"
    program = ["-c", "import sys; from mmgrpo.demo import launch; sys.exit(launch(2, sys.argv[1:]))",
               str(SUPPORT / "demo_interrupt_check.py"), str(out)]
    with log.open("w") as stderr, printed.open("w") as stdout:  # files: no pipe fills up while the test waits
        proc = subprocess.Popen([sys.executable, *program], env={**support_env, "OMP_NUM_THREADS": "1"},
                                stdout=stdout, stderr=stderr)
        metrics = out / "run" / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not (metrics.is_file() and metrics.read_text()) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C sends to its foreground process group
        proc.wait(timeout=240)
    text = log.read_text()
    assert proc.returncode == 128 + signal.SIGINT, text[-3000:]
    assert "Traceback" not in text and "death signal" not in text, text[-3000:]
    steps = len(metrics.read_text().splitlines())
    assert f"stopped by SIGINT at step {steps}, which was validated too;" in (out / "report.md").read_text()
    assert f"step {steps}: validation accuracy = " in printed.read_text()  # its validation, though none was due
    assert (out / "run" / "checkpoints" / f"step-{steps}").is_dir() and (out / "demo.json").is_file()


def test_training_budget_leaves_room_for_the_evaluations_after_training():
    """The default budget stands while the demo fits its limit, and is cut by exactly the overrun otherwise."""
    limit_s = 60.0 * demo.DEMO_LIMIT_MINUTES
    assert demo.training_budget_s(11.0, elapsed_s=60.0, held_out_eval_s=40.0, val_eval_s=10.0) == 660.0
    # a slow machine: 2 minutes before training, 90 s per held-out evaluation, 30 s per validation check
    budget = demo.training_budget_s(14.0, elapsed_s=120.0, held_out_eval_s=90.0, val_eval_s=30.0)
    assert budget == limit_s - 120.0 - 90.0 - 30.0 - demo.FINISH_SECONDS < 14.0 * 60
    assert demo.training_budget_s(14.0, elapsed_s=limit_s, held_out_eval_s=90.0, val_eval_s=30.0) == 0.0


def test_vlm_validation_questions_are_unseen_in_training_and_held_out():
    data = demo.REPO / "assets" / "data" / "shapes_qa"
    spec = demo.DEMOS["vlm"]
    ids = {name: [s.extra["id"] for s in read_samples(data / f"{name}.jsonl", data)]
           for name in ("train", "val", "heldout")}
    assert (demo.REPO / spec.val_file) == data / "val.jsonl" and len(ids["val"]) == spec.num_val
    assert not set(ids["val"]) & set(ids["train"]) and not set(ids["val"]) & set(ids["heldout"])
    kinds = {s.extra["task"] + "/" + s.extra["kind"] for s in read_samples(data / "val.jsonl", data)}
    assert len(kinds) == 6


def test_demo_command_runs_from_any_directory(small_demo, tmp_path, monkeypatch):
    """The presets name assets by repository-relative paths; the command must not depend on the caller's
    directory, and a relative --output-dir is relative to it."""
    from mmgrpo.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["demo", "vlm", "--minutes", "0", "--output-dir", "out"]) == 0
    assert json.loads((tmp_path / "out" / "demo.json").read_text())["metric"] == "accuracy"
    assert (tmp_path / "out" / "report.md").is_file() and not (demo.REPO / "out").exists()


def test_validation_items_cover_every_kind_of_an_interleaved_file():
    """The task files interleave kinds (colour, shape, count, ...); a fixed stride of 15 over 1440 items picked
    only one kind per task, so the validation set is a seeded random draw."""
    kinds = ("colour", "shape", "count", "direction", "order", "clip count")
    items = [{"kind": kinds[3 * t + j], "index": i} for t in range(2) for i in range(240) for j in range(3)]
    picked = demo.validation_items(items, 96)
    assert len(picked) == 96 and len({id(x) for x in picked}) == 96
    assert {x["kind"] for x in picked} == set(kinds)
    assert picked == demo.validation_items(items, 96)  # the same set every run


@pytest.mark.parametrize("value, base, kept", [(0.8, 1.0, True), (0.79, 1.0, False), (0.0, 0.47, False),
                                               (float("nan"), 0.47, False), (0.0, float("nan"), True)])
def test_guard_kept_at_80_percent_of_the_base(value, base, kept):
    assert demo.guard_kept(value, base) is kept


def test_guard_checks_every_kind():
    # a letter habit per kind (A for every colour question, B for every shape one) keeps the pooled spread
    base = {"answer_diversity": 0.9, "answer_diversity/shapes_qa/colour": 0.8, "answer_diversity/shapes_qa/shape": 0.0}
    habit = {"answer_diversity": 1.0, "answer_diversity/shapes_qa/colour": 0.0, "answer_diversity/shapes_qa/shape": 0.0}
    assert demo.guard_failures(habit, base, "answer_diversity") == ["answer_diversity/shapes_qa/colour"]
    fine = {**habit, "answer_diversity/shapes_qa/colour": 0.7}
    assert demo.guard_failures(fine, base, "answer_diversity") == []
    assert demo.guard_failures({"diversity": 10.0}, {"diversity": 20.0}, "diversity") == ["diversity"]


class LetterPolicy:
    """Answers every question from its prompt text alone: ``letter`` for a multiple-choice question, or (with
    ``letter=None``) the letter of the option that holds the correct text; counts are answered right."""

    def __init__(self, letter):
        self.letter = letter
        self.cfg = SimpleNamespace(data=SimpleNamespace(prompt_template="{question}{options}"))

    def generate(self, items):
        texts = []
        for item in items:
            s = item["sample"]
            answer = last = re.search(r"<answer>(.*)</answer>", s.solution).group(1)
            if s.options:
                answer = self.letter or last
            texts.append(f"<think>x</think><answer>{answer}</answer>")
        return RewardBatch(prompts=[it["prompt"] for it in items], group=torch.arange(len(items)),
                           completions=texts, meta=[reward_meta(it["sample"]) for it in items])


def test_circular_accuracy_gives_a_constant_letter_nothing_on_multiple_choice():
    data = demo.REPO / "assets" / "data" / "shapes_qa"
    samples = read_samples(data / "heldout.jsonl", data)[:12]  # colour, shape, count x 2, motion kinds x 2
    items = [{"prompt": render_prompt(s, "{question}{options}"), "sample": s} for s in samples]
    zoo = RewardZoo([RewardSpec(name="accuracy")])
    counts = sum(not s.options for s in samples)
    for letter, expected in (("A", counts / len(samples)), (None, 1.0)):
        policy = LetterPolicy(letter)
        batch = policy.generate(items)
        _, logged, _ = zoo(batch)
        assert demo.circular_accuracy(policy, zoo, items, batch, logged["accuracy"]) == pytest.approx(expected)
    plain = zoo(LetterPolicy("A").generate(items))[1]["accuracy"].mean().item()
    assert plain > counts / len(samples)  # "A" is right on some questions once, never under every rotation


def test_demo_clears_only_its_own_output(tmp_path, capsys):
    from mmgrpo.cli import main

    precious = tmp_path / "work"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    assert main(["demo", "--output-dir", str(precious)]) == 2
    assert "refusing to clear" in capsys.readouterr().err and (precious / "notes.txt").read_text() == "keep me"
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "demo.json").write_text(json.dumps(dict.fromkeys(demo.DEMO_JSON_KEYS, 0)))
    (earlier / "samples.png").write_bytes(b"")
    demo.clear_output_dir(earlier)  # an earlier demo's folder is cleared, and a missing one created
    demo.clear_output_dir(tmp_path / "new")
    assert [p.name for p in earlier.iterdir()] == [demo.DEMO_MARKER] and (tmp_path / "new").is_dir()
    (earlier / "run").mkdir()  # a demo stopped before its report: its marker still lets the next one clear it
    demo.clear_output_dir(earlier)
    assert [p.name for p in earlier.iterdir()] == [demo.DEMO_MARKER]
    with pytest.raises(FileExistsError, match="refusing to clear"):
        demo.clear_output_dir(precious / "notes.txt")


def test_report_guard_note_survives_a_base_that_answers_one_letter():
    # a base model that answers one letter everywhere has answer diversity 0: the report must still be written
    note = demo.held_out_guard_note({"answer_diversity": 0.0}, {"answer_diversity": 0.4}, "answer_diversity")
    assert "`answer_diversity` is 0 for the base model" in note
    assert "within" in demo.held_out_guard_note({"diversity": 20.0}, {"diversity": 17.0}, "diversity")
    assert "OUTSIDE" in demo.held_out_guard_note({"diversity": 20.0}, {"diversity": 15.0}, "diversity")


def test_demo_does_not_clear_a_folder_that_only_happens_to_hold_a_report_md(tmp_path):
    # a project folder with its own report.md (or another tool's demo.json) is not an earlier demo's output
    for name, text in (("report.md", "# my paper's results\n"), ("demo.json", '{"slides": 3}')):
        project = tmp_path / name.replace(".", "_")
        project.mkdir()
        (project / name).write_text(text)
        (project / "results.csv").write_text("keep me")
        with pytest.raises(FileExistsError, match="refusing to clear"):
            demo.clear_output_dir(project)
        assert (project / "results.csv").read_text() == "keep me"
    earlier = tmp_path / "earlier"  # a demo from before the marker: its demo.json has the contract's keys
    earlier.mkdir()
    (earlier / "demo.json").write_text(json.dumps({"task": "ShapesT2I", "metric": "shapes_eval/score",
                                                   "before": 0.4, "after": 0.5, "minutes": 14.2}))
    (earlier / "report.md").write_text("# mmgrpo demo flow\n")
    demo.clear_output_dir(earlier)
    assert [p.name for p in earlier.iterdir()] == [demo.DEMO_MARKER]


def test_a_measure_that_could_not_be_taken_reads_n_a_in_both_tables():
    """report.md wrote "nan" and "+nan" where the printed table said "n/a" (a measure with no value)."""
    rows = demo.table_rows({"accuracy": 0.5, "diversity": float("nan")}, {"accuracy": 0.75, "diversity": 3.0},
                           "accuracy")
    assert rows == [("accuracy", "0.500", "0.750", "+0.250"), ("diversity", "n/a", "3.000", "n/a")]

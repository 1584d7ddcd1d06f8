"""The command line and the packaging contract."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]


def run(*args, **kw):
    return subprocess.run([sys.executable, "-m", "mmgrpo", *args], capture_output=True, text=True, timeout=180,
                          check=False, **kw)


def test_help_lists_every_command():
    out = run("--help").stdout
    for command in ("train", "eval", "sample", "rewards", "bench", "demo"):
        assert re.search(rf"\b{command}\b", out), command


def test_help_starts_without_importing_torch():
    """``mmgrpo --help`` answers in a fraction of a second: the commands import torch when they run, not before."""
    probe = ("import sys\nfrom mmgrpo.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
             "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip().splitlines()[-1] == "False"


def test_rewards_command_lists_kind_and_modality():
    out = run("rewards").stdout
    assert re.search(r"clip_score\s.*pointwise\s.*image", out)
    assert re.search(r"win_rate\s.*groupwise", out)
    assert re.search(r"format\s.*pointwise\s.*text", out)
    assert "[min_len, max_len]" in out  # descriptions are printed as text, not read as rich markup


def test_overrides_may_follow_options_and_counts_must_be_positive(capsys):
    from mmgrpo.cli import parse

    args = parse(["sample", "c.yaml", "a.b=1", "--num", "2", "resume=latest"])
    assert args.num == 2 and args.overrides == ["a.b=1", "resume=latest"]
    for argv in (["sample", "c.yaml", "--num", "0"], ["train", "c.yaml", "--bogus"], ["train", "c.yaml", "--n", "x"]):
        with pytest.raises(SystemExit) as err:
            parse(argv)
        assert err.value.code == 2
    assert "must be >= 1, got 0" in capsys.readouterr().err
    assert parse(["sample", "c.yaml"]).per_prompt == 1 and parse(["sample", "c.yaml", "--per-prompt", "3"]).per_prompt == 3
    for count in ("0", "-2"):
        with pytest.raises(SystemExit) as err:
            parse(["sample", "c.yaml", "--per-prompt", count])
        assert err.value.code == 2
        assert f"--per-prompt: must be >= 1, got {count}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["sample", "c.yaml", "--sample-seed", "-1"])
    assert "--sample-seed: must be >= 0, got -1" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["serve-rewards", "r.yaml", "--port", "70000"], "--port: must be a TCP port in [0, 65535], got 70000"),
    (["serve-rewards", "r.yaml", "--port", "-1"], "--port: must be a TCP port in [0, 65535], got -1"),
    (["bench", "rewards", "--threads", "-1"], "--threads: must be >= 0, got -1"),
])
def test_a_port_or_thread_count_out_of_range_is_a_usage_error(argv, message, capsys):
    """Both reached the socket or torch first: 'OverflowError: bind(): port must be 0-65535' and 'RuntimeError:
    set_num_threads expects a positive integer' tracebacks (the bench one after its suite was set up)."""
    from mmgrpo.cli import parse

    with pytest.raises(SystemExit) as err:
        parse(argv)
    assert err.value.code == 2 and message in capsys.readouterr().err
    assert parse(["serve-rewards", "r.yaml", "--port", "0"]).port == 0  # any free port
    assert parse(["bench", "rewards", "--threads", "0"]).threads == 0  # torch's own count


def test_demo_help_gives_each_demo_budget():
    """The parser is built without importing torch (mmgrpo.demo does), so the budgets are written out in its help:
    this keeps them equal to the DemoSpecs."""
    from mmgrpo.cli import build_parser
    from mmgrpo.demo import DEMO_LIMIT_MINUTES, DEMOS

    demo = build_parser()._subparsers._group_actions[0].choices["demo"]
    text = " ".join(demo.format_help().split())
    for which, spec in DEMOS.items():
        assert f"{spec.train_minutes:g} for {which}" in text, which
    assert f"within {DEMO_LIMIT_MINUTES:g} minutes" in text


def test_unknown_bench_exits_2_and_lists_suites():
    proc = run("bench", "no-such-suite")
    assert proc.returncode == 2 and "no-such-suite" in proc.stderr


def test_unusable_output_paths_are_one_line_before_any_work(tmp_path, monkeypatch, capsys):
    """An output_dir under a file stops before the model loads; a bench --out that is a folder stops before the
    suite runs (whose minutes of results would be lost)."""
    from mmgrpo.bench import BENCHES
    from mmgrpo.cli import main

    (tmp_path / "afile").write_text("x")
    preset = tmp_path / "p.yaml"
    preset.write_text("pipeline: toy_bandit:PIPELINE\n")
    assert main(["train", str(preset), f"output_dir={tmp_path}/afile/run", "logging.progress=false"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.match(r"error: \[Errno 20\] output_dir .*afile/run is under a file: .*afile'$",
                                      err[0]), err
    assert not (tmp_path / "afile").is_dir()
    ran = []
    BENCHES.names()  # load the built-in suites first: the copy below must hold them, and they register once
    monkeypatch.setattr(BENCHES, "_entries", dict(BENCHES._entries))
    BENCHES.register("probe", lambda: ran.append(1) or ([], {}))
    assert main(["bench", "probe", "--out", str(tmp_path)]) == 2 and not ran
    assert capsys.readouterr().err.strip() == f"--out {tmp_path}: cannot write a file there"
    assert main(["bench", "probe", "--out", str(tmp_path / "new" / "P.json")]) == 0 and ran == [1]

    def buggy():
        raise ValueError("a bug minutes into a suite")

    BENCHES.register("buggy", buggy)
    with pytest.raises(ValueError, match="a bug minutes into a suite"):  # its traceback, not a usage line
        main(["bench", "buggy"])


def test_every_package_folder_is_listed_in_pyproject():
    """setuptools installs only the listed packages in a non-editable install; a new sub-package must be added."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    roots = {"mmgrpo": "mmgrpo", "pipelines": "mmgrpo.pipelines", "rewards": "mmgrpo.rewards"}
    found = set()
    for folder, dotted in roots.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((dotted, *rel)))
    assert found == listed


def test_pipelines_and_rewards_import_only_under_mmgrpo():
    import mmgrpo.pipelines
    import mmgrpo.rewards

    assert Path(mmgrpo.pipelines.__file__).parent == ROOT / "pipelines"
    assert Path(mmgrpo.rewards.__file__).parent == ROOT / "rewards"


def test_train_then_eval_and_sample_with_the_checkpoint(tmp_path, capsys):
    """In process (the CLI in a real process: the failing-reward and kill-and-resume tests)."""
    import json

    import yaml

    from mmgrpo.cli import main

    preset = tmp_path / "toy.yaml"
    preset.write_text(yaml.safe_dump({"pipeline": "toy_bandit:PIPELINE", "output_dir": str(tmp_path / "run"),
                                      "train": {"max_steps": 12, "save_every": 6},
                                      "optim": {"lr": 0.2}, "logging": {"tensorboard": False}}))
    assert main(["train", str(preset)]) == 0
    assert "reward/mean" in capsys.readouterr().out  # the end-of-run summary table
    assert main(["eval", str(preset), f"output_dir={tmp_path / 'base'}"]) == 0
    assert main(["eval", str(preset), "resume=latest"]) == 0
    base, run = (json.loads((tmp_path / name / "eval.json").read_text()) for name in ("base", "run"))
    assert base["checkpoint"] is None and run["checkpoint"] == str(tmp_path / "run" / "checkpoints" / "step-12")
    key = "toy_bandit:match_reward"
    assert run["rewards"][key] > base["rewards"][key], (base, run)
    samples = tmp_path / "run" / "samples"
    assert (samples / "eval-step-12.txt").is_file()
    # eval's index: each sample with the scores eval.json averages
    records = json.loads((samples / "eval-step-12" / "index.json").read_text())["samples"]
    assert [r["prompt"] for r in records] == [line.split("\t")[0] for line in
                                              (samples / "eval-step-12.txt").read_text().splitlines()]
    assert sum(r["scores"][key] for r in records) / len(records) == pytest.approx(run["rewards"][key])
    # samples are named after the checkpoint, and a second call does not overwrite the first
    for prompt, name in (("prompt 3", "sample-step-12.txt"), ("prompt 5", "sample-step-12-2.txt")):
        assert main(["sample", str(preset), "resume=latest", "--prompt", prompt]) == 0
        assert (samples / name).read_text().startswith(prompt)
    assert (samples / "sample-step-12.txt").read_text().startswith("prompt 3")
    # each call's index: prompt and completion per sample (a text pipeline has no per-sample files)
    (record,) = json.loads((samples / "sample-step-12" / "index.json").read_text())["samples"]
    prompt, completion = (samples / "sample-step-12.txt").read_text().rstrip("\n").split("\t")
    assert (record["prompt"], record["completion"], record["file"]) == (prompt, completion, None)
    (samples / "sample-step-12-3").mkdir()  # the folder of an interrupted call is not written into
    assert main(["sample", str(preset), "resume=latest", "--prompt", "prompt 7"]) == 0
    assert (samples / "sample-step-12-4.txt").is_file() and not any((samples / "sample-step-12-3").iterdir())
    capsys.readouterr()
    assert main(["eval", str(preset), f"output_dir={tmp_path / 'empty'}", "resume=latest"]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    # a checkpoint of another pipeline, or one whose weights cannot be read: one line naming it
    step6 = tmp_path / "run" / "checkpoints" / "step-6"
    saved = step6 / "config.yaml"
    saved.write_text(saved.read_text().replace("pipeline: toy_bandit:PIPELINE", "pipeline: flow"))
    assert main(["eval", str(preset), f"resume={step6}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    expected = (f"config error: bad value for 'pipeline': 'toy_bandit:PIPELINE', but checkpoint {step6} was made "
                "with 'flow'; its weights and state depend on it: use the old value, or another checkpoint")
    assert err == [expected]
    (tmp_path / "run" / "checkpoints" / "step-12" / "policy" / "model.safetensors").write_bytes(b"torn")
    assert main(["sample", str(preset), "resume=latest"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.match(r"config error: bad value for 'resume': checkpoint .*step-12 cannot be read", err[0])


def test_a_failing_reward_stops_the_run_with_one_line(tmp_path, support_env):
    import os

    import yaml

    (tmp_path / "failing_reward.py").write_text("def fn(batch):\n    raise ValueError('the judge is down')\n")
    preset = tmp_path / "toy.yaml"
    preset.write_text(yaml.safe_dump({"pipeline": "toy_bandit:PIPELINE", "output_dir": str(tmp_path / "run"),
                                      "rewards": [{"name": "failing_reward:fn"}], "train": {"max_steps": 2},
                                      "logging": {"tensorboard": False}}))
    env = {**support_env, "PYTHONPATH": f"{tmp_path}{os.pathsep}{support_env['PYTHONPATH']}"}
    failed = run("train", str(preset), env=env)
    assert failed.returncode == 1
    assert failed.stderr.strip().splitlines()[-1] == ("error: reward 'failing_reward:fn' failed: ValueError: the "
                                                      "judge is down")
    assert "Traceback" not in failed.stderr


def test_demo_says_where_it_runs_and_fails_when_its_asset_is_missing(monkeypatch, capsys):
    import dataclasses

    from mmgrpo import cli, demo

    spec = dataclasses.replace(demo.DEMOS["flow"], asset="assets/no-such-model")
    monkeypatch.setitem(demo.DEMOS, "flow", spec)
    assert cli.main(["demo"]) == 2
    captured = capsys.readouterr()
    assert "needs assets/no-such-model" in captured.err and "Run it from a clone" in captured.err
    assert not re.search(r"\d+(\.\d+)?\s*%|before\s*[:=]\s*\d", captured.out + captured.err)


@pytest.mark.parametrize("minutes", ["-1", "nan", "inf"])
def test_demo_minutes_must_be_a_finite_number_of_minutes(minutes, capsys):
    from mmgrpo.cli import main

    with pytest.raises(SystemExit) as done:
        main(["demo", "--minutes", minutes])
    assert done.value.code == 2 and "must be a number of minutes >= 0" in capsys.readouterr().err


def test_a_cpu_run_with_deepspeed_installed_prints_no_accelerator_notice():
    """With DeepSpeed installed (the dev extra), accelerate's unwrap_model imports it in every run, and on a machine
    without an accelerator DeepSpeed logged "Setting accelerator to CPU. If you have GPU ..." into the demo's output;
    the command line filters that one notice out of DeepSpeed's logger."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (the dev extra installs it on Linux)")
    code = ("import torch, sys\n"
            "from mmgrpo.cli import main\n"
            "main(['rewards'])\n"
            "import deepspeed\n"
            "print('cuda' if torch.cuda.is_available() else 'cpu', file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    if proc.stderr.strip().endswith("cuda"):
        pytest.skip("a CUDA machine: DeepSpeed logs no CPU notice there")
    assert "Setting accelerator" not in proc.stderr + proc.stdout, proc.stderr

"""Run logging beyond metrics.jsonl: tensorboard event files and an offline wandb run (both in the dev extra), and
the summary table."""

import json
import subprocess
import sys

import pytest
from toy_bandit import ToyConfig

from mmgrpo.config import load_config
from mmgrpo.tracking import (
    MetricsLog,
    headline_keys,
    plot_file_name,
    plot_metrics,
    print_whole,
    read_metrics,
    redraw_due,
    summary_table,
)
from mmgrpo.trainer import Trainer

ROWS = [{"step": 1, "loss": 0.5, "reward/mean": 0.25, "eval/accuracy": float("nan")},
        {"step": 2, "loss": 0.25, "reward/mean": 0.5}]


def test_tensorboard_gets_every_scalar_of_a_run(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (the dev extra installs it)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = load_config(None, [f"output_dir={tmp_path}", "logging.progress=false", "logging.plot_every=0",
                             "logging.tensorboard=true", "train.max_steps=3"], schema=ToyConfig)
    Trainer(cfg).train()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 3
    for key in ("reward/mean", "loss", "ratio/onpolicy_max_dev", "time/step_s"):
        logged = [(e.step, e.value) for e in events.Scalars(key)]
        assert [s for s, _ in logged] == [1, 2, 3]
        assert [v for _, v in logged] == pytest.approx([r[key] for r in rows], rel=1e-6, abs=1e-12)


def test_a_resume_drops_the_tensorboard_points_after_its_checkpoint(tmp_path):
    """A run killed at step 4 and resumed from its checkpoint at step 2 logs steps 3 and 4 again; their first
    values stayed in the event files, so tensorboard drew both runs' points after step 2."""
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (the dev extra installs it)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = MetricsLog(tmp_path, {}, tensorboard=True, wandb=False, wandb_project="p", resume_step=None)
    for step in range(1, 5):
        first.log({"step": step, "loss": float(step)})
    first.close()
    resumed = MetricsLog(tmp_path, {}, tensorboard=True, wandb=False, wandb_project="p", resume_step=2)
    for step in (3, 4):
        resumed.log({"step": step, "loss": -float(step)})
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, -3.0), (4, -4.0)]
    assert [r["loss"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1.0, 2.0, -3.0, -4.0]


def test_numpy_and_tensor_scalars_are_logged_as_numbers_and_non_finite_ones_as_null(tmp_path):
    """A pipeline's counters or a custom reward's statistics may be numpy or torch scalars: they were refused by
    json ('float32 is not JSON serializable', stopping the run after its step trained), or, as np.float32 NaN,
    escaped the NaN -> null cleaning."""
    import numpy as np
    import torch

    log = MetricsLog(tmp_path, {}, tensorboard=False, wandb=False, wandb_project="p", resume_step=None)
    log.log({"step": np.int64(1), "a": np.float32(0.5), "b": np.int64(3), "c": torch.tensor(1.5),
             "d": np.float32("nan"), "e": torch.tensor(float("inf")), "f": np.bool_(True), "g": float("nan")})
    log.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    assert json.loads(text) == {"step": 1, "a": 0.5, "b": 3, "c": 1.5, "d": None, "e": None, "f": True, "g": None}
    assert "NaN" not in text and "Infinity" not in text


def test_a_resume_that_cannot_rewrite_metrics_leaves_them_whole(tmp_path):
    """Resuming at step 80 rewrites metrics.jsonl to its first 80 rows. When that write fails (here a 4 KiB file
    size limit, as a full disk would), the 100 rows are still there; a working resume keeps the first 80."""
    rows = [{"step": i, "reward/mean": 0.1 * i, "pad": "x" * 200} for i in range(1, 101)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    script = ("import resource, signal, sys; from pathlib import Path; from mmgrpo.tracking import MetricsLog\n"
              "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
              "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))\n"
              "try:\n    MetricsLog(Path(sys.argv[1]), {}, False, False, 'p', resume_step=80)\n"
              "except OSError as err:\n    print(type(err).__name__)\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "OSError"
    assert read_metrics(tmp_path / "metrics.jsonl") == rows
    MetricsLog(tmp_path, {}, False, False, "p", resume_step=80).close()
    assert read_metrics(tmp_path / "metrics.jsonl") == rows[:80]
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


def test_wandb_offline_run_gets_config_steps_and_summary(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (the dev extra installs it)")
    monkeypatch.setenv("WANDB_MODE", "offline")  # no account or network: the run is written to disk
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = MetricsLog(tmp_path, {"train": {"max_steps": 2}}, tensorboard=False, wandb=True, wandb_project="t",
                     resume_step=None)
    run = log.wandb
    try:
        for row in ROWS:
            log.log(row)
        assert run.config["train"]["max_steps"] == 2 and run.project == "t" and run.step == 2
        # wandb holds a step's values until the next step: step 1's are committed, at wandb's own step axis
        summary = {key: run.summary[key] for key in run.summary.keys()}  # noqa: SIM118 (a wandb Summary, not a dict)
        assert summary["loss"] == 0.5 and summary["reward/mean"] == 0.25 and "step" not in summary
    finally:
        log.close()
    files = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1 and files[0].stat().st_size > 0
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


def test_the_summary_table_keeps_long_metric_names_whole_off_a_terminal(capsys):
    """Printed to a file or pipe (here pytest's capture), the table is as wide as it needs, not cut to 80 columns."""
    long = "eval/shapes_eval/background/mean/with/a/long/tail"
    rows = [{"step": 1, "reward/mean": 0.125, long: 1.0, "loss": -3.353e-08},
            {"step": 2, "reward/mean": 0.25, long: 0.5, "loss": 2.782e-06}]
    print_whole(summary_table(rows, "run"))
    lines = capsys.readouterr().out.splitlines()
    row = next(line for line in lines if long in line)
    assert "2.782e-06" in next(line for line in lines if "loss" in line) and len(row) > 80


def test_the_summary_shows_a_nan_frac_only_when_it_was_not_always_0():
    rows = [{"step": 1, "reward/a/nan_frac": 0.5, "reward/b/nan_frac": 0.0},
            {"step": 2, "reward/a/nan_frac": 0.0, "reward/b/nan_frac": 0.0}]
    assert [k for k in headline_keys(rows) if k.endswith("nan_frac")] == ["reward/a/nan_frac"]


def test_plots_of_rewards_named_by_file_have_portable_file_names(tmp_path):
    key = "reward//tmp/journey/my_rewards.py:redness/mean"
    assert plot_file_name(key) == "reward_tmp_journey_my_rewards.py_redness_mean.png"
    written = plot_metrics([{"step": 1, key: 0.5}, {"step": 2, key: 0.7}], tmp_path)
    assert [p.name for p in written if "redness" in p.name] == ["reward_tmp_journey_my_rewards.py_redness_mean.png"]


def test_a_redraw_is_due_at_a_multiple_of_plot_every_while_redraws_stay_within_their_share():
    # one step per iteration: steps 10 and 20 are multiples of 10, step 11 is not
    assert redraw_due(10, 10, 10, spent_s=0.0, elapsed_s=1.0, max_share=0.05)
    assert not redraw_due(11, 11, 10, spent_s=0.0, elapsed_s=1.0, max_share=0.05)
    # an iteration of several steps that passes a multiple (steps 9-12 hold 10) is due, one that does not is not
    assert redraw_due(9, 12, 10, spent_s=0.0, elapsed_s=1.0, max_share=0.05)
    assert not redraw_due(11, 19, 10, spent_s=0.0, elapsed_s=1.0, max_share=0.05)
    # 2.5 s of redraws in 40 s is 6% > 5%: wait; in 50 s it is 5%: draw
    assert not redraw_due(20, 20, 10, spent_s=2.5, elapsed_s=40.0, max_share=0.05)
    assert redraw_due(20, 20, 10, spent_s=2.5, elapsed_s=50.0, max_share=0.05)


@pytest.mark.parametrize("max_share", [1.0, 0.0])
def test_redraws_during_a_run_keep_to_their_share_of_the_wall_clock(tmp_path, monkeypatch, max_share):
    """At share 1 every step of a plot_every=1 run redraws; at share 0 only the first does (nothing spent yet), and
    the curves are still drawn at the end."""
    import mmgrpo.trainer as trainer_module

    calls = []
    draw = trainer_module.plot_metrics
    monkeypatch.setattr(trainer_module, "plot_metrics", lambda rows, out: calls.append(len(rows)) or draw(rows, out))
    cfg = load_config(None, [f"output_dir={tmp_path}", "logging.progress=false", "logging.tensorboard=false",
                             "logging.plot_every=1", f"logging.plot_max_share={max_share}", "train.max_steps=6",
                             "train.save_every=0"], schema=ToyConfig)
    Trainer(cfg).train()
    during, final = calls[:-1], calls[-1]
    assert during == ([1, 2, 3, 4, 5, 6] if max_share == 1.0 else [1]), calls
    assert final == 6 and (tmp_path / "plots" / "reward_mean.png").is_file()


def test_a_resume_continues_the_wandb_run_and_sends_no_step_twice(tmp_path, monkeypatch):
    """``wandb.init(resume="allow")`` had no run id, so every resume started another wandb run. The id is kept in
    the run directory and a resume continues that run. wandb drops a step below one it already has: a run killed
    after step 4 and resumed from its checkpoint at step 2 sends steps 5 on to wandb (which keeps the killed run's
    3 and 4), while metrics.jsonl gets the resumed 3 and 4. A fresh run starts a new wandb run."""
    pytest.importorskip("wandb", reason="wandb is not installed (the dev extra installs it)")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    first = MetricsLog(tmp_path, {}, tensorboard=False, wandb=True, wandb_project="t", resume_step=None)
    run_id = first.wandb.id
    for step in range(1, 5):
        first.log({"step": step, "loss": float(step)})
    first.close()
    with pytest.warns(RuntimeWarning, match=r"steps 3-4 .* wandb run .*from step 5"):
        resumed = MetricsLog(tmp_path, {}, tensorboard=False, wandb=True, wandb_project="t", resume_step=2)
    sent, send = [], resumed.wandb.log
    monkeypatch.setattr(resumed.wandb, "log", lambda row, step: sent.append(step) or send(row, step=step))
    try:
        assert resumed.wandb.id == run_id
        for step in range(3, 7):
            resumed.log({"step": step, "loss": -float(step)})
        assert sent == [5, 6] and resumed.wandb.step == 6
    finally:
        resumed.close()
    assert [r["loss"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1.0, 2.0, -3.0, -4.0, -5.0, -6.0]
    again = MetricsLog(tmp_path, {}, tensorboard=False, wandb=True, wandb_project="t", resume_step=6)
    assert again.wandb.id == run_id  # nothing beyond the checkpoint: no warning, every new step is sent
    again.close()
    fresh = MetricsLog(tmp_path, {}, tensorboard=False, wandb=True, wandb_project="t", resume_step=None)
    fresh.close()
    assert fresh.wandb.id != run_id
    assert {p.name.split("-")[3] for p in (tmp_path / "wandb").glob("offline-run-*")} == {run_id, fresh.wandb.id}


def test_wandb_that_cannot_start_is_one_line_naming_the_key(tmp_path, monkeypatch, support_env):
    """``logging.wandb=true`` without a wandb account ended ``mmgrpo train`` in a wandb UsageError traceback; it is
    one config-error line (exit 2) that names the key and the offline mode."""
    pytest.importorskip("wandb", reason="wandb is not installed (the dev extra installs it)")
    env = {k: v for k, v in support_env.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path / "home"), WANDB_MODE="online", WANDB_SILENT="true")
    preset = tmp_path / "p.yaml"
    preset.write_text(f"pipeline: toy_bandit:PIPELINE\noutput_dir: {tmp_path / 'run'}\ntrain: {{max_steps: 1}}\n"
                      "logging: {wandb: true, tensorboard: false, progress: false}\n")
    done = subprocess.run([sys.executable, "-m", "mmgrpo", "train", str(preset)], capture_output=True, text=True,
                          env=env, timeout=300, check=False)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("config error: logging.wandb=true but wandb did not start: ") and "WANDB_MODE=offline" \
        in last and "Traceback" not in done.stderr, done.stderr

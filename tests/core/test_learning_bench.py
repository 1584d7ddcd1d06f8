"""`mmgrpo bench learning`: every preset is its demo preset with only the algorithm changed, and the
time-to-target math."""

import json
import math

import pytest

from mmgrpo.config import load_config
from mmgrpo.demo import DEMOS, REPO
from mmgrpo.learning import PRESET_DIR, PRESETS, time_to_reach


def test_the_bench_runs_every_preset_of_its_folder():
    assert sorted(PRESETS) == sorted(p.stem for p in (REPO / PRESET_DIR).glob("*.yaml"))


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_differs_from_its_demo_preset_only_in_the_algorithm(name, tmp_path):
    cfg = load_config(REPO / PRESET_DIR / f"{name}.yaml", [f"output_dir={tmp_path}"])
    base = load_config(REPO / DEMOS[cfg.pipeline].preset, [f"output_dir={tmp_path}"])
    assert cfg.model == base.model and cfg.optim == base.optim and cfg.train == base.train
    assert cfg.data == base.data and cfg.seed == base.seed
    if cfg.pipeline == "flow":
        assert cfg.rewards == base.rewards and cfg.grpo == base.grpo and cfg.sampling == base.sampling
        assert (cfg.mode.name == base.mode.name) == (name == "mixgrpo")
    else:
        assert [r for r in cfg.rewards if r.name != "temporal_bonus"] == base.rewards
        assert cfg.tgrpo.enabled == (name == "vlm_tgrpo")
        assert any(r.name == "temporal_bonus" for r in cfg.rewards) == cfg.tgrpo.enabled


def test_time_to_reach_is_the_first_mark_at_or_above_the_target():
    curve = [(0.0, 0.2), (2.0, 0.25), (4.0, 0.31), (6.0, 0.29)]
    assert time_to_reach(curve, 0.3) == 4.0
    assert time_to_reach(curve, 0.2) == 0.0
    assert math.isnan(time_to_reach(curve, 0.5))


def test_bench_json_is_strict(tmp_path, monkeypatch):
    from mmgrpo.bench import BENCHES, run_bench

    BENCHES.names()  # load the built-in suites first, so that the patched copy (restored after) holds them
    monkeypatch.setattr(BENCHES, "_entries", dict(BENCHES._entries))
    BENCHES.register("nan_suite", lambda: ([{"case": "a", "ratio": math.nan}], {"never_reached": math.inf, "x": 1.5}))
    run_bench("nan_suite", str(tmp_path / "B.json"))

    def reject(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    saved = json.loads((tmp_path / "B.json").read_text(), parse_constant=reject)
    assert saved["rows"] == [{"case": "a", "ratio": None}] and saved["figures"] == {"never_reached": None, "x": 1.5}


@pytest.mark.parametrize("argv, message", [
    (["bench", "learning", "--only", "mixgrpo,nosuch"], "unknown learning preset 'nosuch' (available: flow_grpo, "),
    (["bench", "rewards", "--only", "clip_score"], "benchmark 'rewards' always runs all its cases"),
])
def test_a_bad_bench_selection_exits_2_before_running(argv, message, capsys):
    from mmgrpo.cli import main

    assert main(argv) == 2
    assert capsys.readouterr().err.startswith(message)


def test_an_out_path_under_a_file_is_a_one_line_error_before_running(tmp_path, capsys):
    from mmgrpo.cli import main

    (tmp_path / "notes.txt").write_text("")
    assert main(["bench", "rewards", "--out", str(tmp_path / "notes.txt" / "B.json")]) == 2
    assert capsys.readouterr().err.startswith(f"--out {tmp_path / 'notes.txt' / 'B.json'}: cannot write")


def test_ctrl_c_during_a_preset_stops_the_bench(monkeypatch):
    """A first Ctrl-C makes the trainer finish its step and return; the bench then read the row of a run cut short
    (a KeyError before the first mark, a truncated curve reported as the final model after it) and went on to the
    next preset. It now stops with KeyboardInterrupt, which the CLI turns into 'interrupted' and exit 130."""
    import os
    import signal

    import mmgrpo.config
    from mmgrpo import learning
    from mmgrpo.trainer import Trainer

    small = ["data.num_eval=2", "train.prompts_per_step=2", "train.group_size=2", "train.micro_batch_size=4",
             "num_threads=1"]
    real_load, real_step, real_run = mmgrpo.config.load_config, Trainer.train_on_rollout, learning.run_preset
    monkeypatch.setattr(mmgrpo.config, "load_config", lambda path, overrides: real_load(path, [*overrides, *small]))

    def step_then_ctrl_c(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # arrives during the step: the trainer's handler asks it to stop
        return real_step(self, *args, **kwargs)

    started = []
    monkeypatch.setattr(Trainer, "train_on_rollout", step_then_ctrl_c)
    monkeypatch.setattr(learning, "run_preset", lambda name, out: started.append(name) or real_run(name, out))
    with pytest.raises(KeyboardInterrupt):
        learning.learning(("flow_grpo", "mixgrpo"))
    assert started == ["flow_grpo"]

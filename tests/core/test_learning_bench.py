"""`mmgrpo bench learning`: every variant is a valid config of its demo preset, and the time-to-target math."""

import json
import math

import pytest

from mmgrpo.config import load_config
from mmgrpo.demo import DEMOS, REPO
from mmgrpo.learning import VARIANTS, time_to_reach


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_variant_loads_and_differs_only_in_the_algorithm(name, tmp_path):
    which, overrides = VARIANTS[name]
    preset = REPO / DEMOS[which].preset
    cfg = load_config(preset, [f"output_dir={tmp_path}", *overrides])
    base = load_config(preset, [f"output_dir={tmp_path}"])
    assert cfg.model == base.model and cfg.optim == base.optim and cfg.train == base.train
    if which == "flow":
        assert cfg.mode.name == (overrides[0].split("=")[1] if overrides else base.mode.name)
        assert cfg.rewards == base.rewards


def test_time_to_reach_is_the_first_mark_at_or_above_the_target():
    curve = [(0.0, 0.2), (2.0, 0.25), (4.0, 0.31), (6.0, 0.29)]
    assert time_to_reach(curve, 0.3) == 4.0
    assert time_to_reach(curve, 0.2) == 0.0
    assert math.isnan(time_to_reach(curve, 0.5))


def test_bench_json_is_strict(tmp_path, monkeypatch):
    from mmgrpo.bench import BENCHES, run_bench

    monkeypatch.setattr(BENCHES, "_entries", dict(BENCHES._entries))
    BENCHES.register("nan_suite", lambda: ([{"case": "a", "ratio": math.nan}], {"never_reached": math.inf, "x": 1.5}))
    run_bench("nan_suite", str(tmp_path / "B.json"))

    def reject(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    saved = json.loads((tmp_path / "B.json").read_text(), parse_constant=reject)
    assert saved["rows"] == [{"case": "a", "ratio": None}] and saved["figures"] == {"never_reached": None, "x": 1.5}

"""The command line and the packaging contract."""

import re
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def run(*args, **kw):
    return subprocess.run([sys.executable, "-m", "mmgrpo", *args], capture_output=True, text=True, timeout=180,
                          check=False, **kw)


def test_help_lists_every_command():
    out = run("--help").stdout
    for command in ("train", "eval", "sample", "rewards", "bench", "demo"):
        assert re.search(rf"\b{command}\b", out), command


def test_rewards_command_lists_kind_and_modality():
    out = run("rewards").stdout
    assert re.search(r"clip_score\s.*pointwise\s.*image", out)
    assert re.search(r"win_rate\s.*groupwise", out)
    assert re.search(r"format\s.*pointwise\s.*text", out)


def test_unknown_bench_exits_2_and_lists_suites():
    proc = run("bench", "no-such-suite")
    assert proc.returncode == 2 and "no-such-suite" in proc.stderr


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

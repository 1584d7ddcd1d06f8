import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmgrpo import checkpoint
from mmgrpo.data import GroupSampler


@settings(max_examples=40, deadline=None)
@given(num_items=st.integers(1, 30), per_rank=st.integers(1, 5), world=st.integers(1, 4), steps=st.integers(1, 6),
       data=st.data())
def test_ranks_split_each_step_disjointly_and_group_ids_are_unique(num_items, per_rank, world, steps, data):
    samplers = [GroupSampler(num_items, per_rank * world, world, r, seed=3) for r in range(world)]
    seen_ids = set()
    for _ in range(steps):
        # a full step, or a refill round of fewer prompts (the same count on every process)
        per = data.draw(st.integers(1, per_rank))
        outs = [s.next(per * world) for s in samplers]
        ids = [i for _, gid in outs for i in gid]
        assert all(len(items) == per for items, _ in outs)
        assert len(ids) == per * world and not (set(ids) & seen_ids)
        seen_ids |= set(ids)
    assert all(s.state_dict() == samplers[0].state_dict() for s in samplers)


def test_a_rollout_larger_than_a_step_or_uneven_over_processes_is_refused():
    s = GroupSampler(10, 4, world_size=2, rank=0)
    for bad in (0, 3, 6):
        with pytest.raises(ValueError, match=f"a rollout of {bad} prompts over 2 processes"):
            s.next(bad)


def test_epoch_covers_every_item_once_and_state_resumes():
    s = GroupSampler(10, 5, seed=1)
    first_epoch = s.next()[0] + s.next()[0]
    assert sorted(first_epoch) == list(range(10))
    state = s.state_dict()
    expected = [s.next() for _ in range(3)]
    t = GroupSampler(10, 5, seed=1)
    t.load_state_dict(state)
    assert [t.next() for _ in range(3)] == expected


@settings(max_examples=30, deadline=None)
@given(num_items=st.integers(2, 40), per_rank=st.integers(1, 6), world=st.integers(1, 3), seed=st.integers(0, 9))
def test_a_step_across_an_epoch_end_draws_no_prompt_twice(num_items, per_rank, world, seed):
    """A step that took an epoch's last prompts and the next epoch's first drew a prompt twice, on one process or
    two, whenever the two ends shared one (27% of the steps of 100 prompts at 32 per step). A step of at most
    ``num_items`` prompts now holds distinct prompts, and every epoch still draws every prompt once."""
    per_step = per_rank * world
    if per_step > num_items:
        return
    samplers = [GroupSampler(num_items, per_step, world, r, seed=seed) for r in range(world)]
    drawn = []
    for _ in range(3 * num_items // per_step + 2):
        step = [i for s in samplers for i in s.next()[0]]
        assert len(set(step)) == len(step), step
        drawn += step
    for epoch in range(len(drawn) // num_items):
        assert sorted(drawn[epoch * num_items:(epoch + 1) * num_items]) == list(range(num_items))


def test_a_resume_after_an_epoch_end_continues_the_sequence_and_old_states_load():
    s = GroupSampler(10, 4, seed=2)
    for _ in range(3):  # the third step crosses into epoch 1
        s.next()
    state = s.state_dict()
    expected = [s.next() for _ in range(4)]
    t = GroupSampler(10, 4, seed=2)
    t.load_state_dict(json.loads(json.dumps(state)))  # as trainer_state.json holds it
    assert [t.next() for _ in range(4)] == expected
    old = GroupSampler(10, 4, seed=2)  # a checkpoint from before held-back prompts: the plain order, as it drew
    old.load_state_dict({"epoch": 0, "position": 4, "steps": 1})
    assert sorted(old.next()[0] + old.next()[0][:2]) == sorted(GroupSampler(10, 4, seed=2)._order(0)[4:])


def test_a_resume_on_a_dataset_of_another_size_starts_a_new_epoch_with_a_warning():
    """The saved position indexed a permutation of another size: a resumed run on a grown dataset drew, silently,
    the tail of a fresh permutation (prompts of this epoch again, others never), and on a shrunk one skipped ahead."""
    s = GroupSampler(10, 4, seed=0)
    s.next()
    state = s.state_dict()
    t = GroupSampler(12, 4, seed=0)
    with pytest.warns(RuntimeWarning, match="the checkpoint's sampler drew from 10 training items and this run has "
                                            "12: epoch 1 starts here"):
        t.load_state_dict(state)
    assert (t.epoch, t.position, t.steps) == (1, 0, 1)
    assert sorted(i for _ in range(3) for i in t.next()[0]) == list(range(12))


def test_latest_ignores_partial_checkpoints_and_prune_keeps_newest(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        d = root / f"step-{step}"
        d.mkdir(parents=True)
        (d / checkpoint.STATE_FILE).write_text(json.dumps({"step": step}))
    (root / "step-8").mkdir()                  # renamed but without state: impossible through finalize
    (root / ".tmp-step-10").mkdir()            # a write that was interrupted
    (root / ".old-step-6").mkdir()             # a replaced step-6 set aside, not deleted yet
    assert checkpoint.resolve_resume("latest", tmp_path) == root / "step-6"
    assert checkpoint.resolve_resume(None, tmp_path) is None
    checkpoint.prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["step-4", "step-6", "step-8"]


def test_finalize_is_a_rename(tmp_path):
    tmp = checkpoint.temporary_dir(tmp_path, 3)
    tmp.mkdir(parents=True)
    (tmp / "weights").write_text("w")
    final = checkpoint.finalize(tmp, {"step": 3})
    assert final.name == "step-3" and not tmp.exists() and (final / "weights").read_text() == "w"
    assert checkpoint.read_state(final) == {"step": 3}
    again = checkpoint.temporary_dir(tmp_path, 3)  # the same step saved again replaces it
    again.mkdir()
    (again / "weights").write_text("w2")
    assert checkpoint.finalize(again, {"step": 3}) == final and (final / "weights").read_text() == "w2"
    assert sorted(p.name for p in final.parent.iterdir()) == ["step-3"]  # the old one set aside, then deleted


def test_a_pipeline_change_is_reported_before_the_keys_it_changes():
    """A flow checkpoint resumed by a vlm run differs in many model.* keys; the error names the pipeline."""
    old = {"pipeline": "flow", "model.attention_backend": "auto", "model.path": "a", "seed": 0, "optim.lr": 1.0}
    new = {"pipeline": "vlm", "model.attention_backend": None, "model.path": "b", "seed": 0, "optim.lr": 2.0}
    fixed, other = checkpoint.config_changes(old, new)
    assert fixed == ["pipeline", "model.attention_backend", "model.path"] and other == ["optim.lr"]
    error = checkpoint.fixed_change(old, new, Path("ckpt"))
    assert str(error).startswith("bad value for 'pipeline': 'vlm', but checkpoint ckpt was made with 'flow'")
    assert checkpoint.fixed_change(old, new, Path("ckpt"), keys=("seed",)) is None


def test_finalize_puts_every_file_on_disk_before_the_rename(tmp_path, monkeypatch):
    """Only trainer_state.json was fsynced: after a power loss the renamed step-N could hold the state file but
    weights that never left the page cache (empty files), and resume=latest picked it as complete."""
    import os

    synced, real_fsync = [], os.fsync

    def recording_fsync(fd):
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")).resolve())
        real_fsync(fd)

    tmp = checkpoint.temporary_dir(tmp_path, 3)
    (tmp / "policy").mkdir(parents=True)
    (tmp / "policy" / "model.safetensors").write_bytes(b"weights")
    (tmp / "optimizer.bin").write_bytes(b"moments")
    monkeypatch.setattr(os, "fsync", recording_fsync)
    final = checkpoint.finalize(tmp, {"step": 3})
    moved = [final / "policy" / "model.safetensors", final / "optimizer.bin", final / "policy", final]
    written = {tmp.resolve() / p.relative_to(final) for p in moved}  # fsynced under the temporary name
    assert written <= set(synced), written - set(synced)


def test_a_prune_cut_short_leaves_no_checkpoint_that_looks_complete(tmp_path, monkeypatch):
    """Pruning deleted an old checkpoint's files in place, in directory order: a run killed part-way through left a
    step-N with its trainer_state.json but without some weights, listed as complete (the checkpoint a 'cannot be
    read' error names to resume from instead). It is renamed out of the checkpoint names before it is deleted."""
    import shutil

    root = tmp_path / "checkpoints"
    for step in (2, 4):
        (root / f"step-{step}" / "policy").mkdir(parents=True)
        (root / f"step-{step}" / "policy" / "model.safetensors").write_bytes(b"w")
        (root / f"step-{step}" / checkpoint.STATE_FILE).write_text(json.dumps({"step": step}))

    real_rmtree = shutil.rmtree

    def killed_part_way(path, ignore_errors=False):
        real_rmtree(Path(path) / "policy")  # some files go, then the process is killed
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", killed_part_way)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.prune(tmp_path, keep_last=1)
    monkeypatch.undo()
    assert all((path / "policy" / "model.safetensors").is_file() for _, path in checkpoint.checkpoint_dirs(tmp_path))
    checkpoint.prune(tmp_path, keep_last=1)  # the next prune deletes what is left
    assert sorted(p.name for p in root.iterdir()) == ["step-4"]

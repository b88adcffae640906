"""Chapter 8: labkit.checkpoint as a library (layout, store, crash trials, bench, resume, ZeRO-1
layout, interval), and lab 8's checkers on real ranks: the reference answers pass, and every wrong
answer the issue names fails in the check of the task it belongs to."""
import math
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lab_notebooks
import labkit
from labkit import checks as base_checks
from labkit.checkpoint import (CheckpointError, bench, checks, checks_async, checks_resume, crash,
                               interval, killclock, layout, resume, store, zero)
from labkit.grading.references import checkpoint as checkpoint_reference

ROOT = Path(__file__).resolve().parents[2]
LAB = "lab08_checkpoints"
SOLUTION = ROOT / "solutions" / LAB / f"{LAB}.ipynb"


def _namespace():
    """The lab's setup cell without its world: the names an answer cell sees."""
    import nbformat
    cells = nbformat.read(str(SOLUTION), as_version=4).cells
    setup = next(c for c in cells if c.metadata.get("nbgrader", {}).get("grade_id") == "setup")
    namespace = {"__name__": "__main__"}      # functions pickle by value, as from a notebook
    exec(setup.source.split("\nworld = ")[0], namespace)
    return namespace, cells


def reference():
    """Every answer cell of the solution, run in one namespace."""
    namespace, cells = _namespace()
    for cell in cells:
        if cell.metadata.get("nbgrader", {}).get("solution"):
            exec(compile(cell.source, f"{SOLUTION.name}:{cell.metadata.nbgrader.grade_id}",
                         "exec"), namespace)
    return namespace


def variant(source: str, base: dict) -> dict:
    """`base` with the definitions in `source` replaced (a wrong answer)."""
    namespace = dict(base)
    exec(compile(source, "<wrong answer>", "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.fixture(scope="module", autouse=True)
def _close_worlds():
    yield
    labkit.shutdown_all()


# ---- layout and store, one process ----------------------------------------------------------

@pytest.mark.parametrize("bad", ["", ".", "..", "a/b", "../x", "/abs", "x\\y", ".hidden",
                                 "a..b", "x" * 101, 7, None])
def test_check_name_refuses_what_could_leave_the_folder(bad):
    with pytest.raises(CheckpointError):
        layout.check_name(bad)


def test_the_lab_checkers_rank_programs_leave_no_scratch_folder(tmp_path, monkeypatch):
    """The retention checks run in a folder of their own per rank and check, removed whether the
    program returns or raises (they used to stay in TMPDIR: 738 of them after a day's runs)."""
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    seen = []

    @checks._in_a_scratch_folder
    def program(share, collect, folder):
        seen.append(folder)
        Path(folder, "shard").write_bytes(b"x")
        if share == "raise":
            raise RuntimeError("the collect under test failed")
        return os.listdir(folder)

    assert program("return", None) == ["shard"]
    with pytest.raises(RuntimeError, match="collect under test"):
        program("raise", None)
    assert len(seen) == 2 and all(Path(f).parent == tmp_path for f in seen)
    assert list(tmp_path.iterdir()) == []
    assert all(getattr(checks, name).__wrapped__ for name in
               ("_retention_program", "_trials_program", "_leases_program"))


@given(st.integers(0, 10 ** 9 - 1), st.integers(0, 10 ** 9 - 1))
def test_snapshot_ids_sort_by_step(a, b):
    assert (layout.snapshot_id(a) < layout.snapshot_id(b)) == (a < b)


def test_store_round_trip_and_immutability(tmp_path):
    sid = layout.snapshot_id(3)
    entries = [store.write_shard(tmp_path, sid, f"rank{r}.bin", bytes([r]) * (1000 + r))
               for r in range(3)]
    store.commit(tmp_path, sid, entries, {"step": 3})
    found = store.load_latest(tmp_path)
    assert found["snapshot_id"] == sid and found["shards"]["rank2.bin"] == b"\x02" * 1002
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(FileExistsError):
        store.commit(tmp_path, sid, entries, {"step": 3})
    with pytest.raises(FileExistsError):
        store.write_shard(tmp_path, sid, "rank0.bin", b"new")
    assert sorted(os.listdir(tmp_path)) == before and (tmp_path / sid / "rank0.bin").read_bytes() \
        == b"\x00" * 1000


@pytest.mark.parametrize("damage", ["missing", "truncated", "outside", "absolute", "torn"])
def test_verify_names_the_problem_and_load_latest_falls_back(tmp_path, damage):
    for step in (1, 2):
        sid = layout.snapshot_id(step)
        store.commit(tmp_path, sid, [store.write_shard(tmp_path, sid, "a.bin", b"x" * 100)], {})
    sid = layout.snapshot_id(2)
    shard, manifest = tmp_path / sid / "a.bin", Path(layout.manifest_path(tmp_path, sid))
    if damage == "missing":
        shard.unlink()
    elif damage == "truncated":
        shard.write_bytes(b"x" * 50)
    elif damage in ("outside", "absolute"):
        outside = tmp_path.parent / f"outside-{tmp_path.name}.bin"
        outside.write_bytes(b"x" * 100)
        manifest.write_text(manifest.read_text().replace(
            f"{sid}/a.bin", f"../{outside.name}" if damage == "outside" else str(outside)))
    else:
        manifest.write_bytes(manifest.read_bytes()[:30])
    with pytest.raises(CheckpointError) as error:
        store.verify(tmp_path, sid)
    assert sid in str(error.value)
    found = store.load_latest(tmp_path)
    assert found["snapshot_id"] == layout.snapshot_id(1) and found["skipped"][0][0] == sid


def test_commit_folder_publishes_another_writers_files(tmp_path):
    sid = layout.snapshot_id(5)
    (tmp_path / sid / "sub").mkdir(parents=True)
    (tmp_path / sid / ".metadata").write_bytes(b"meta")
    (tmp_path / sid / "sub" / "__0_0.distcp").write_bytes(b"data" * 100)
    store.commit_folder(tmp_path, sid, {"step": 5})
    found = store.load_latest(tmp_path)
    assert found["shards"] == {".metadata": b"meta", "sub/__0_0.distcp": b"data" * 100}


def test_the_course_store_and_resume_need_no_guard(tmp_path):
    """The guard that switched them off in lab 8 is gone (one assignment turned it back on):
    task 1 builds on the store, and resume refuses the ZeRO-1 trainer task 2 is about."""
    import importlib.util
    assert importlib.util.find_spec("labkit.checkpoint._guard") is None
    store.save(tmp_path, "step-000000001", {"a.bin": b"x"}, {})
    assert store.load_latest(tmp_path)["shards"] == {"a.bin": b"x"}
    with pytest.raises(CheckpointError, match="replicated trainer"):
        resume.capture(bench.Trainer(dict(bench.CONFIG, optimizer="zero1")))


# ---- crash trials ------------------------------------------------------------------------------

_SAVE = variant("""
def save(root, step):
    from labkit.checkpoint import layout, store
    sid = layout.snapshot_id(step)
    return store.commit(root, sid, [store.write_shard(root, sid, "a.bin", b"y" * 70_000)], {})
""", {})["save"]                                  # by value: a victim need not import this file


def test_victims_kill_at_every_event_and_the_store_never_tears(tmp_path):
    with crash.Victims() as victims:
        (tmp_path / "clean").mkdir()
        clean = victims.run(_SAVE, str(tmp_path / "clean"), 1)
        names = [name for _, name, _ in clean["events"]]
        assert names == ["write", "write", "fsync", "fsync", "fsync", "write", "fsync", "link",
                         "unlink", "fsync"]
        for k in range(1, len(names) + 1):
            for when in ("kill_before", "kill_after"):
                root = tmp_path / f"{when}{k}"
                root.mkdir()
                _SAVE(str(root), 0)
                out = victims.run(_SAVE, str(root), 1, plan={when: k})
                assert out["status"] == "killed" and tuple(out["killed_at"][:2]) == (k, when[5:])
                linked = k > 8 or (k == 8 and when == "kill_after")
                assert store.load_latest(root)["snapshot_id"] == layout.snapshot_id(int(linked))


def test_victims_timer_pause_and_timeout():
    import time
    with crash.Victims() as victims:
        out = victims.run(time.sleep, 5, plan={"kill_after_seconds": 0.05})
        assert out["status"] == "killed" and out["killed_at"] == "timer"
        out = victims.run(time.sleep, 5, plan={"timeout": 0.2})
        assert out["status"] == "timeout"
        out = victims.run(int, "x")
        assert out["status"] == "error" and out["error"]["type"] == "ValueError"
        with pytest.raises(ValueError, match="unknown plan keys"):
            victims.run(int, "1", plan={"kil_before": 1})


# ---- bench, resume, ZeRO-1 layout, interval ------------------------------------------------------

def test_strict_resume_is_bitwise_and_a_warm_start_is_not():
    straight = bench.Trainer()
    straight.train(7)
    reference_print = bench.fingerprint(straight)
    first = bench.Trainer()
    first.train(3)
    blob = resume.to_bytes(resume.capture(first))
    again = bench.Trainer()
    resume.restore(again, resume.from_bytes(blob))
    again.train(4)
    assert bench.differences(reference_print, bench.fingerprint(again)) == []
    warm = bench.Trainer()
    warm.model.load_state_dict(resume.from_bytes(blob)["model"])
    warm.train(4)
    assert "weights" in bench.differences(reference_print, bench.fingerprint(warm))


def test_restore_refuses_another_tokenizer_and_changes_nothing():
    source = bench.Trainer()
    state = resume.capture(source)
    other = bench.Trainer(dict(bench.CONFIG, vocab=bench.CONFIG["vocab"][::-1]))
    before = bench.fingerprint(other)
    with pytest.raises(CheckpointError, match="tokenizer"):
        resume.restore(other, state)
    assert bench.differences(before, bench.fingerprint(other)) == []


@given(st.lists(st.integers(1, 40), min_size=1, max_size=6), st.integers(1, 9))
def test_flat_layout_ranges_cover_the_vector_once(numels, world_size):
    flat = zero.FlatLayout([(f"p{i}", (n,)) for i, n in enumerate(numels)], world_size)
    covered = [i for r in range(world_size) for i in range(*flat.range(r))]
    assert covered == list(range(flat.padded)) and flat.padded - flat.numel < world_size
    assert zero.FlatLayout.from_dict(flat.to_dict(), 3).offsets == flat.offsets


@pytest.mark.parametrize("example", interval.DALY_EXAMPLES)
def test_daly_worked_examples(example):
    s = interval.DALY_SETUP
    assert abs(interval.daly_interval(s["C_min"], example["M_min"]) - example["tau_opt_min"]) \
        <= (0.05 if example["M_min"] < 60 else 0.5)


@settings(max_examples=30, deadline=None)
@given(st.floats(1, 600), st.floats(3600, 1e6))
def test_young_minimises_the_first_order_waste(C, M):
    tau = interval.young_interval(C, M)
    assert interval.first_order_waste(tau, C, M) <= min(
        interval.first_order_waste(tau * f, C, M) for f in (0.9, 1.1))


def test_simulation_matches_daly_for_exponential_failures():
    tau, C, M, R, W = 60.0, 5.0, 600.0, 20.0, 3000.0
    walls = interval.simulate(W, tau, C, R, interval.failure_sampler("exponential", M), 4000, 1)
    expected = interval.daly_wall_time(tau, C, M, R, W)
    assert abs(walls.mean() - expected) < 4 * walls.std() / math.sqrt(len(walls))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 12), st.floats(0, 3),
       st.lists(st.floats(0.01, 30), min_size=0, max_size=8))
def test_killclock_replay_is_interval_simulate_with_the_same_failures(work, tau, C, gaps):
    """replay (the schedule the real kills are compared with) is interval.simulate's model, R = 0,
    fed the same times between failures (then none for a long while)."""
    failures = [sum(gaps[:i + 1]) for i in range(len(gaps))]
    queue = list(gaps) + [1e12] * 100

    def draw(rng, n):
        return [queue.pop(0) for _ in range(n)]

    import numpy as np
    wall = interval.simulate(float(work), float(tau), C if C > 0 else 1e-12, 0.0,
                             lambda rng, n: np.array(draw(rng, n)), trials=1)[0]
    got = killclock.replay(work, tau, C if C > 0 else 1e-12, failures)
    assert math.isclose(got["wall"], wall, rel_tol=1e-9, abs_tol=1e-9)
    assert all(0 <= s <= work and s % tau == 0 for s in got["resumed_from"])


def test_killclock_replay_averages_to_daly_with_no_restart_time():
    work, tau, C, M, runs = 60, 5, 1.0, 12.0, 3000
    walls = [killclock.replay(work, tau, C, killclock.failure_times(M, 2000.0, seed))["wall"]
             for seed in range(runs)]
    mean = sum(walls) / runs
    sd = math.sqrt(sum((w - mean) ** 2 for w in walls) / (runs - 1))
    assert abs(mean - interval.daly_wall_time(tau, C, M, 0.0, work)) < 4 * sd / math.sqrt(runs)


def test_killclock_real_ranks_resume_where_the_schedule_says(tmp_path):
    """Real ranks, SIGKILLed on the clock: each restart loads the newest save that finished
    before its failure (a kill during a save leaves none), and the job's wall is the replay's."""
    world = labkit.world(2, teaching=False)
    seed = next(seed for seed in range(100) if len(killclock.replay(
        12, 3, 1.0, killclock.failure_times(5.0, 1e3, seed))["resumed_from"]) >= 2)
    run = killclock.run_job(world, str(tmp_path), work=12, tau=3, C=1.0, M=5.0, seed=seed)
    expected = killclock.replay(12, 3, 1.0, run["failures"])
    assert run["failures"] and run["restarts"] >= len(run["failures"]) - 1
    assert run["resumed_from"] == expected["resumed_from"]
    assert math.isclose(run["wall"], expected["wall"], rel_tol=1e-12)


def test_killclock_under_torchrun_loses_what_the_schedule_says(tmp_path):
    """Issue 29: the same job under torchrun, whose agent restarts new interpreters after each
    SIGKILL: attempt a knows its failure from TORCHELASTIC_RESTART_COUNT, resumes from what the
    store verified, and the job's failures, resume points and wall are the replay's."""
    seed = next(seed for seed in range(100) if len(killclock.replay(
        12, 3, 1.0, killclock.failure_times(5.0, 1e3, seed))["resumed_from"]) == 2)
    run = killclock.run_job_torchrun(str(tmp_path), work=12, tau=3, C=1.0, M=5.0, seed=seed)
    clock = killclock.failure_times(5.0, killclock._horizon(12, 3, 1.0, 5.0), seed)
    expected = killclock.replay(12, 3, 1.0, clock)
    assert run["restarts"] == 2 and run["failures"] == clock[:2]
    assert run["resumed_from"] == expected["resumed_from"]
    assert math.isclose(run["wall"], expected["wall"], rel_tol=1e-12)
    assert len(run["restart_seconds"]) == 2 and all(0 < s < 60 for s in run["restart_seconds"])
    with pytest.raises(ValueError, match="whole steps"):
        killclock.run_job_torchrun(str(tmp_path / "never"), work=12, tau=2.5, C=1.0, M=5.0, seed=0)


def test_killclock_refuses_fractional_steps():
    with pytest.raises(ValueError, match="whole steps"):
        killclock.replay(10, 2.5, 1.0, [])


@settings(max_examples=60, deadline=None)
@given(st.integers(20, 100), st.integers(2, 8), st.integers(1, 10), st.integers(0, 150),
       st.integers(0, 30), st.floats(0, 1))
def test_reference_simulate_async_agrees_with_the_one_failure_closed_form(ref_ns, tau, n, stall,
                                                                          write, restart, where):
    work = float(tau * n)
    end = checkpoint_reference.one_failure_wall_time(work, tau, stall, write, restart)
    failure = where * end
    assert math.isclose(ref_ns["simulate_async"](work, tau, stall, write, restart, [failure]),
                        checkpoint_reference.one_failure_wall_time(work, tau, stall, write, restart,
                                                           failure), abs_tol=1e-9)


@pytest.fixture(scope="module")
def ref_ns():
    return reference()


# ---- lab 8's checkers on real ranks: the reference passes, each wrong answer fails ---------------

def answer_source(grade_id):
    import nbformat
    cell = next(c for c in nbformat.read(str(SOLUTION), as_version=4).cells
                if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id)
    return cell.source


def wrong(grade_id, base_ns, *replacements):
    """The reference answer of `grade_id` with (old, new) text replacements, in a fresh namespace
    (each replaced text must occur: the test would otherwise test the reference)."""
    source = answer_source(grade_id)
    for old, new in replacements:
        assert old in source, f"{old!r} not in the reference answer of {grade_id}"
        source = source.replace(old, new)
    namespace, _ = _namespace()
    namespace.update({k: v for k, v in base_ns.items() if k not in namespace})
    exec(compile(source, f"<wrong {grade_id}>", "exec"), namespace)
    return namespace


TASK1 = "task1_collect"
WRONG8 = lab_notebooks.wrong_answers(LAB)     # the graded wrong answers (tests/grading)
TASK1_CHECKS = ("retention", "crash", "leases")       # one test cell each
WRONG_TASK1 = {
    # name: (the one check it fails, message, replacements)
    "trusts sizes and never hashes (a flipped byte passes)": (
        "retention", "newest", [("            store.verify(folder, sid)                # sizes "
                                 "and SHA-256 of every shard",
                                 "            m = json.load(open(manifest_path(folder, sid)))\n"
                                 "            if not all(os.path.getsize(os.path.join(folder, e["
                                 "'path'])) == e['bytes'] for e in m['shards']):\n"
                                 "                raise ValueError('a shard has the wrong size')")]),
    "keeps the newest published ids, verified or not": (          # graded, with "ignores leases"
        "retention", "newest", [WRONG8.UNVERIFIED]),
    "leaves what killed saves leave": (
        "retention", "not collected", [("            os.unlink(path)                          # a "
                                        "killed save's temporary manifest", "            pass"),
                                       ("        elif os.path.isdir(path) and name not in kept:",
                                        "        elif os.path.isdir(path) and name in gone:")]),
    "removes the shards before the manifest": (
        "crash", "still published", [("    for sid in gone:                                 # 1. "
                                      "unpublish: no loader can pick it now\n",
                                      "    for sid in gone:\n"
                                      "        shutil.rmtree(os.path.join(folder, sid), "
                                      "ignore_errors=True)\n")]),
    "ignores leases": ("leases", "lease", [WRONG8.IGNORES_LEASES]),
}


def run_task1(check, ns, world, seed=None):
    case = None if seed is None else base_checks.Case(f"lab 8, task 1: {check}", seed=seed)
    if check == "retention":
        checks.check_retention(world, ns["collect"], timeout=60, case=case)
    elif check == "leases":
        checks.check_leases(world, ns["collect"], timeout=60, case=case)
    else:
        return checks.check_collect_crash_trials(world, ns["collect"], trials=40, timeout=120,
                                                 case=case)


@pytest.fixture
def world3():
    """The 3-rank world, alive: labkit.world returns the live one with these settings, or a new
    one where a test in between made a world of its own (one world at a time closes the other)."""
    return labkit.world(3, teaching=False)


@pytest.mark.timeout(300)
def test_task1_reference_passes(ref, world3):
    for check in TASK1_CHECKS:
        run_task1(check, ref, world3)
    tally = run_task1("crash", ref, world3, seed=81)
    assert tally["collects killed"] >= 30 and tally["saves killed"] >= 30, tally


def test_task1_flipped_byte_keeps_size_path_and_json(tmp_path):
    """The damage that only a SHA-256 sees: same size, same path, same manifest."""
    sid = layout.snapshot_id(1)
    store.save(tmp_path, sid, {n: bytes(range(200)) for n in checks.SHARD_NAMES}, {})
    before = checks.observe(str(tmp_path))
    checks._damage(str(tmp_path), sid, "flipped byte")
    after = checks.observe(str(tmp_path))
    shard = f"{sid}/{checks.SHARD_NAMES[1]}"
    assert after["manifests"] == before["manifests"] and after["dirs"] == before["dirs"]
    assert after["files"][shard][0] == before["files"][shard][0]
    assert after["files"][shard][1] != before["files"][shard][1]
    assert checks.verified_ids(before) == [sid] and checks.verified_ids(after) == []
    with pytest.raises(CheckpointError, match="SHA-256"):
        store.verify(tmp_path, sid)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", WRONG_TASK1)
def test_task1_a_wrong_answer_loses_exactly_its_cell(name, ref, world3):
    check, message, replacements = WRONG_TASK1[name]
    ns = wrong(TASK1, ref, *replacements)
    for other in TASK1_CHECKS:
        if other == check:
            with pytest.raises(AssertionError, match=message):
                run_task1(other, ns, world3, seed=82)
        else:
            run_task1(other, ns, world3, seed=82)


@pytest.mark.timeout(300)
def test_task1_a_collect_that_removes_nothing_loses_the_crash_cell_too(ref, world3):
    """Issue 26, class 3: a collect that returns at once tears nothing, so it passed the crash
    trials (it lost only retention and leases); now the trials also require that a collect that
    returned left at most `keep` verified snapshots published."""
    ns = wrong(TASK1, ref, ("    names = sorted(os.listdir(folder))\n",
                            "    return []\n    names = sorted(os.listdir(folder))\n"))
    for check, message in (("crash", "removes nothing"), ("retention", "newest"),
                           ("leases", "lease|removed|still")):
        with pytest.raises(AssertionError, match=message):
            run_task1(check, ns, world3, seed=83)


TASK2 = "task2_zero1_resume"
WRONG_TASK2 = {
    "forgets the data cursor": [("    trainer.data.position = parts[0][\"data\"][\"position\"]\n", "")],
    "forgets NumPy's RNG state": [("    np.random.set_state((name, keys.numpy().astype(np.uint32), "
                                   "*rest))\n", "")],
    "forgets the optimizer's current learning rate": [
        ("    opt.param_groups[0][\"lr\"] = parts[0][\"lr\"]\n", "")],
    "never checks the run's identity": [("    for key in (\"tokenizer\", \"config\", \"code\"):",
                                         "    for key in ():")],
}
REPLAYS = [("    old = FlatLayout.from_dict(parts[0][\"layout\"])\n",
            "    if len(parts) == trainer.world_size:           # replay: same run, same steps\n"
            "        trainer.train(parts[0][\"steps\"])\n        return\n"
            "    old = FlatLayout.from_dict(parts[0][\"layout\"])\n")]


@pytest.mark.timeout(300)
def test_task2_reference_passes(ref):
    world = labkit.world(2, teaching=False)
    checks_resume.check_zero1_resume(world, ref["capture_zero1"], ref["restore_zero1"])
    checks_resume.check_zero1_reshard(lambda n: labkit.world(n, teaching=False),
                                      ref["capture_zero1"], ref["restore_zero1"], saved_on=4,
                                      loaded_on=(3,))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", WRONG_TASK2)
def test_task2_rejects(name, ref):
    ns = wrong(TASK2, ref, *WRONG_TASK2[name])
    with pytest.raises(AssertionError):
        checks_resume.check_zero1_resume(labkit.world(2, teaching=False), ns["capture_zero1"],
                                         ns["restore_zero1"])


@pytest.mark.timeout(300)
def test_task2_a_replay_loses_the_same_world_size_cell_only(ref):
    """A restore that replays the training from the start (at the same world size) matched the
    straight run before the detour; now it loses that cell and keeps the other world size's."""
    ns = wrong(TASK2, ref, *REPLAYS)
    with pytest.raises(AssertionError, match="replaying its steps"):
        checks_resume.check_zero1_resume(labkit.world(2, teaching=False), ns["capture_zero1"],
                                         ns["restore_zero1"])
    checks_resume.check_zero1_reshard(lambda n: labkit.world(n, teaching=False),
                                      ns["capture_zero1"], ns["restore_zero1"], saved_on=4,
                                      loaded_on=(3,))


@pytest.mark.timeout(300)
def test_task2_rejects_a_reshard_that_ignores_the_layout(ref):
    own_range = wrong(TASK2, ref, ("getattr(opt, name).copy_(flat[start:end])",
                                   "getattr(opt, name).copy_(parts[trainer.rank][name])"))
    with pytest.raises((AssertionError, labkit.LabkitError), match="moments laid end to end|raised"):
        checks_resume.check_zero1_reshard(lambda n: labkit.world(n, teaching=False),
                                          own_range["capture_zero1"], own_range["restore_zero1"],
                                          saved_on=3, loaded_on=(2,))
    # ... and keeps the same world size's cell (its own range is the right one there)
    checks_resume.check_zero1_resume(labkit.world(2, teaching=False), own_range["capture_zero1"],
                                     own_range["restore_zero1"])


TASK3 = "task3_async_checkpointer"
WRONG_TASK3 = {
    "copies in the background thread, after the next step": (
        "copy", "read by another thread|snapshot of step",
        [("        for key in state:                    # the copy: the next step may change the "
          "tensors\n            target[key].copy_(state[key])\n", "        self.live = state\n"),
         ("                self.write(step, self.sets[index])",
          "                for key in self.live:\n                    self.sets[index][key]"
          ".copy_(self.live[key])\n                self.write(step, self.sets[index])")]),
    "hands the live tensors to the write": (
        "copy", "snapshot of step|live tensors",
        [("            self.queue.append((step, index))",
          "            self.sets[index] = dict(state)\n            self.queue.append((step, index))")]),
    "saves synchronously": (
        "copy", "did not return while its write",
        [("            self.queue.append((step, index))\n            self.changed.notify_all()\n",
          "            self.queue.append((step, index))\n            self.changed.notify_all()\n"
          "            while self.queue:\n                self.changed.wait()\n")]),
    "has one set of buffers (waits for every write in flight)": (
        "flight", "waited for it although", [("self.free = [0, 1]", "self.free = [0]")]),
    "runs two writes at once (a thread per save)": (
        "flight", "two writes ran at once",
        [("            self.queue.append((step, index))\n            self.changed.notify_all()\n",
          "            threading.Thread(target=self._write_one, args=(step, index)).start()\n"),
         ("    def _report(self):", "    def _write_one(self, step, index):\n        try:\n"
          "            self.write(step, self.sets[index])\n        except BaseException as problem:"
          "\n            self.failure = problem\n        with self.changed:\n"
          "            self.free.append(index)\n            self.changed.notify_all()\n\n"
          "    def _report(self):"),
         ("            while self.queue:\n                self.changed.wait()\n            self._report()",
          "            while len(self.free) < 2:\n                self.changed.wait()\n"
          "            self._report()")]),
    "copies a third snapshot while two are in flight": (
        "flight", "third copy", [("self.sets = [None, None]", "self.sets = [None] * 8"),
                                 ("self.free = [0, 1]", "self.free = list(range(8))")]),
    "swallows a failed write": (
        "flight", "went unnoticed", [("self.failure = self.failure or problem", "pass")]),
    "allocates new buffers at every save": (
        "flight", "different sets of host buffers", [("        if self.sets[index] is None:\n",
                                                      "        if True:\n")]),
}


@pytest.mark.timeout(300)
def test_task3_reference_passes(ref):
    checks_async.check_async_checkpointer(labkit.world(2, teaching=False), ref["AsyncCheckpointer"])


@pytest.mark.timeout(300)
def test_task3_one_buffer_set_loses_the_buffering_cell_only(ref):
    """Right copy, wrong buffering: save(3) blocks on write 2. The checker no longer runs the
    next training step while that save() has not returned, so the copy cell holds (several
    runs: it was lost by a timing window)."""
    ns = wrong(TASK3, ref, ("self.free = [0, 1]", "self.free = [0]"))
    world = labkit.world(2, teaching=False)
    for _ in range(3):
        checks_async.check_async_checkpointer(world, ns["AsyncCheckpointer"], aspects=("copy",))
    with pytest.raises(AssertionError, match="waited for it although"):
        checks_async.check_async_checkpointer(world, ns["AsyncCheckpointer"], aspects=("flight",))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", WRONG_TASK3)
def test_task3_rejects(name, ref):
    aspect, message, replacements = WRONG_TASK3[name]
    ns = wrong(TASK3, ref, *replacements)
    with pytest.raises(AssertionError, match=message):
        checks_async.check_async_checkpointer(labkit.world(2, teaching=False),
                                              ns["AsyncCheckpointer"], aspects=(aspect,))


TASK4 = "task4_interval"


@pytest.mark.timeout(300)
def test_task4_reference_passes_and_wrong_answers_fail(ref):
    world = labkit.world(2, teaching=False)
    checks_async.check_simulate_async(world, ref["simulate_async"])
    checks_async.check_simulate_matches_daly(world, ref["simulate_async"])
    checks_async.check_async_interval(ref["async_interval"])
    taken = wrong(TASK4, ref, ("                    pending, since = (t + write, done), 0.0",
                               "                    pending, since = (t, done), 0.0"))
    with pytest.raises(AssertionError, match="write had finished"):
        checks_async.check_simulate_async(world, taken["simulate_async"])
    ignores_restart_failures = wrong(TASK4, ref, ("                t = upcoming\n                i += 1",
                                                  "                i += 1"))
    with pytest.raises(AssertionError, match="write had finished"):
        checks_async.check_simulate_async(world, ignores_restart_failures["simulate_async"])
    for name, answer in (("with the write in the stall", "math.sqrt(2 * (stall + write) * mtbf)"),
                         ("the write never matters", "math.sqrt(2 * stall * mtbf)")):
        ns = wrong(TASK4, ref, ("    return max(write, math.sqrt(2 * stall * mtbf))",
                                f"    return {answer}"))
        with pytest.raises(AssertionError, match="async_interval"):
            checks_async.check_async_interval(ns["async_interval"])
        checks_async.check_simulate_async(world, ns["simulate_async"])   # the other cell holds


@pytest.mark.parametrize("stall, write, mtbf", [(2.0, 500.0, 3600.0), (5.0, 150.0, 1000.0),
                                                (2.0, 40.0, 3600.0)])
def test_async_interval_is_what_the_simulator_finds_best(ref_ns, stall, write, mtbf):
    """tau* = max(write, sqrt(2 stall M)) against the lab's own simulator, with the same
    exponential failure traces for every tau: within 3% of the best tau of a grid, and, when the
    write is longer than sqrt(2 stall M), sqrt(2 stall M) itself loses far more."""
    import numpy as np
    rng = np.random.default_rng(8)
    work, restart = 20 * mtbf, 10.0
    traces = [np.cumsum(rng.exponential(mtbf, 400)).tolist() for _ in range(150)]
    lost = lambda tau: float(np.mean([ref_ns["simulate_async"](work, tau, stall, write, restart,
                                                               f) for f in traces])) - work
    best = checkpoint_reference.async_interval(stall, write, mtbf)
    assert math.isclose(ref_ns["async_interval"](stall, write, mtbf), best)
    grid = {f: lost(best * f) for f in (0.5, 0.7, 0.85, 1.0, 1.2, 1.5, 2.0)}
    assert grid[1.0] <= 1.03 * min(grid.values()), grid
    young = math.sqrt(2 * stall * mtbf)
    if write > young:
        assert lost(young) > 1.5 * grid[1.0], (lost(young), grid)


# DCP's dedup of replicated (plain) tensors: each key's single copy goes to the rank whose plan is
# smallest so far (torch/distributed/checkpoint/_dedup_save_plans.py), not always to rank 0.
DEDUP_FLOATS = {"embed": 8, "norm1": 2, "norm2": 2, "bias": 2, "head": 8, "scale": 1}


def _dcp_replicated_save(folder):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    rank = dist.get_rank()
    dcp.save({key: torch.full((n,), float(rank)) for key, n in DEDUP_FLOATS.items()},
             checkpoint_id=folder)
    loaded = {key: torch.zeros(n) for key, n in DEDUP_FLOATS.items()}
    dcp.load(loaded, checkpoint_id=folder)
    return {key: int(t[0].item()) for key, t in loaded.items()}


def test_dcp_replicated_keys_are_spread_over_the_ranks_files(tmp_path, world3):
    from labkit.checkpoint import dcp_files
    folder = str(tmp_path / "dcp")
    loads = world3.run(_dcp_replicated_save, folder)
    # worked by hand from the rule, P = 3, bytes 32, 8, 8, 8, 32, 4:
    # embed -> 0 (32,0,0); norm1 -> 1 (32,8,0); norm2 -> 2 (32,8,8); bias -> 1 (32,16,8);
    # head -> 2 (32,16,40); scale -> 1
    expected = {"embed": 0, "norm1": 1, "norm2": 2, "bias": 1, "head": 2, "scale": 1}
    on_disk = dcp_files.key_files(folder)
    assert {key: rank for key, (rank, _, _) in on_disk.items()} == expected
    assert all(load == expected for load in loads), loads       # the copy each key came from
    sizes = dcp_files.file_sizes(folder)
    assert sorted(sizes) == [0, 1, 2] and sizes[1] > sizes[2] > sizes[0], sizes   # 3, 2, 1 keys


def _dcp_shard_first_save(folder, plain_floats):
    """w ([16 P], Shard(0)) first, then plain keys, each rank saving its own number."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size,))
    state = {"w": DTensor.from_local(torch.full((16,), float(rank)), mesh, [Shard(0)])}
    state.update({key: torch.full((n,), float(rank)) for key, n in plain_floats.items()})
    dcp.save(state, checkpoint_id=folder)


def test_dcp_dedup_counts_a_shard_at_its_whole_tensors_bytes(tmp_path, world3):
    """The walk of _dedup_save_plans.py counts each item at tensor_storage_size(), which reads the
    *global* size: rank 0's shard of w ([48] float32) counts 192 bytes, not 64. Worked by hand,
    P = 3, plain keys a, b (160 B each), c (4 B): global count (192, 0, 0) -> a: 1, b: 2,
    c: 1 (160 = 160 < 192, lowest rank on the tie); a rule that counts the shard's own 64 bytes
    sends c to rank 0. The other ranks' shards are met after rank 0's whole plan."""
    from labkit.checkpoint import dcp_files
    folder = str(tmp_path / "dcp")
    world3.run(_dcp_shard_first_save, folder, {"a": 40, "b": 40, "c": 1})
    right = {("w", (0,)): 0, ("w", (16,)): 1, ("w", (32,)): 2, "a": 1, "b": 2, "c": 1}
    rows = dcp_files.check_writers(folder, right)
    assert [row[0] for row in rows] == list(right) and all(p == o for _, p, o in rows), rows
    with pytest.raises(ValueError, match=r"'c': predicted rank 0, written by rank 1"):
        dcp_files.check_writers(folder, dict(right, c=0))         # the shard's own bytes
    with pytest.raises(ValueError, match=r"'a': predicted rank 0.*'b': predicted rank 0"):
        dcp_files.check_writers(folder, dict(right, a=0, b=0, c=1))   # "rank 0's copy"
    with pytest.raises(ValueError, match="split over ranks"):
        dcp_files.check_writers(folder, {"w": 0})                  # a shard, named as a key
    with pytest.raises(ValueError, match="not in"):
        dcp_files.check_writers(folder, {"d": 0})


def _replicated_bench_on_dcp(config, folder):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    trainer = bench.Trainer(config)
    trainer.train(2)
    model_state, optimizer_state = get_state_dict(trainer.model, trainer.optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder)
    return sum(p.numel() for p in trainer.model.parameters())


def test_dcp_writes_one_copy_of_a_replicated_trainer_12_bytes_per_parameter(tmp_path, world3):
    """No gradients in a checkpoint: FP32 weights + two AdamW moments = 12 Psi bytes on disk, and
    once for the world (dedup), not once per rank (3 x 12 Psi at P = 3)."""
    from labkit.checkpoint import dcp_files
    folder = str(tmp_path / "dcp")
    psi = world3.run(_replicated_bench_on_dcp, dict(bench.CONFIG, hidden=1024), folder)[0]
    sizes = dcp_files.file_sizes(folder)
    assert sorted(sizes) == [0, 1, 2] and all(sizes.values()), sizes   # spread over the ranks
    assert sum(sizes.values()) == pytest.approx(12 * psi, rel=0.01), (sizes, psi)


def test_dcp_files_refuses_an_unfinished_save(tmp_path):
    from labkit.checkpoint import dcp_files
    with pytest.raises(FileNotFoundError, match="no .metadata"):
        dcp_files.key_files(str(tmp_path))
    with pytest.raises(ValueError, match="not a DCP data file"):
        dcp_files.writer_rank("rank0.bin")


def test_dcp_quiet_hides_the_loaders_tracebacks_not_the_refusal(tmp_path, capfd):
    """dcp.load of a folder without .metadata logs two tracebacks on the root logger (torch 2.13)
    and raises; under dcp_files.quiet() it still raises, and prints nothing."""
    import logging
    import torch
    import torch.distributed.checkpoint as dcp
    from labkit.checkpoint import dcp_files
    handler = logging.StreamHandler()                 # what a notebook's root logger shows
    logging.getLogger().addHandler(handler)
    try:
        def load():
            try:
                dcp.load({"w": torch.zeros(2)}, checkpoint_id=str(tmp_path), no_dist=True)
            except BaseException as error:            # CheckpointException is a BaseException
                return dcp_files.refusal(error)
            return None
        loud = load()
        noisy = capfd.readouterr().err
        with dcp_files.quiet():
            quiet = load()
            logging.getLogger().warning("not DCP's: still shown")
        silent = capfd.readouterr().err
    finally:
        logging.getLogger().removeHandler(handler)
    assert loud and quiet and "\n" not in quiet, (loud, quiet)
    assert "Traceback" in noisy, "torch no longer logs the fallback: the test shows nothing"
    assert "Traceback" not in silent and "not DCP's: still shown" in silent, silent


def test_phase_table_reads_each_trial_from_the_rank_that_ran_its_victim():
    from labkit.checkpoint import trials
    def record(victim, status, killed_at, torn=False, loaded=1, newest=1):
        return {"victim": victim, "n_events": 3, "status": status, "killed_at": killed_at,
                "loaded": loaded, "newest_complete": newest, "torn": torn}
    # trial 0: rank 1's writer killed while writing; trial 1: rank 0's committer after the link
    rank0 = [record(("writer", 1), "not reached", None),
             record(("committer",), "killed", (5, "after", "link"), loaded=2, newest=2)]
    rank1 = [record(("writer", 1), "killed", (1, "before", "write"), torn=True, loaded=0),
             record(("committer",), "not reached", None, loaded=2, newest=2)]
    rows = trials.phase_table([rank0, rank1])
    assert rows == {"writer: while writing its shard": [1, 1, 0],
                    "committer: after the link (the commit point)": [1, 0, 1]}, rows
    with pytest.raises(ValueError, match="one record per trial"):
        trials.phase_table([rank0, rank1[:1]])


@pytest.mark.timeout(300)
def test_task4_a_failure_in_a_copy_is_drawn_on_purpose(ref):
    """Issue 26, class 4: a simulator that keeps the checkpoint whose copy a failure interrupted
    is wrong only when a failure lands in a copy (about 1 draw in 10); every configuration now
    has one there (and one with its write in flight), so even 3 configurations catch it, and
    the interval cell keeps its points."""
    ns = wrong(TASK4, ref, ("                if failed:\n                    t = upcoming\n"
                            "                else:\n                    t += stall",
                            "                if failed:\n                    t = upcoming\n"
                            "                    durable = (t, done)\n"
                            "                else:\n                    t += stall"))
    world = labkit.world(2, teaching=False)
    for seed in (91, 92, 93):
        with pytest.raises(AssertionError, match="write had finished"):
            checks_async.check_simulate_async(world, ns["simulate_async"], cases=3,
                                              case=base_checks.Case("lab 8, task 4", seed=seed))
    checks_async.check_async_interval(ns["async_interval"])


# ---- the chapter's self-checks (labkit.checkpoint.selfcheck) --------------------------------------

def test_selfcheck_naive_torn_judges_the_answer_and_guards_the_measurement(capsys):
    from labkit.checkpoint import selfcheck
    assert selfcheck.naive_torn("ba", "ab") and not selfcheck.naive_torn("abc", "ab")
    assert not selfcheck.naive_torn("", "ab")
    assert "put your letters" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="expects 'ab'"):
        selfcheck.naive_torn("a", "a")


def test_selfcheck_young_4096_is_sqrt_2CM_at_four_times_llamas_M():
    from labkit.checkpoint import selfcheck
    M = interval.llama3_mtbf_hours() * 3600 * 4
    truth = math.sqrt(2 * 30 * M) / 60
    assert selfcheck.young_4096(truth * 1.04) and not selfcheck.young_4096(truth * 1.1)
    assert not selfcheck.young_4096(math.sqrt(2 * 30 * M / 4) / 60)      # M of the 16k job
    assert not selfcheck.young_4096(None)


# ---- DCP under the crash harness (labkit.checkpoint.dcp_trials) ------------------------------------

def _dcp_round(stores, base):
    """A clean DCP save of step 1 published by the commit on top, then step 2 with rank 1 killed
    after its write: the plain folder is refused, the committed root still loads step 1."""
    import torch.distributed as dist
    from labkit.checkpoint import dcp_trials, snapshot_id
    dcp_trials.start_victims()
    root = os.path.join(base, "committed")
    first = dcp_trials.trial(stores, os.path.join(root, snapshot_id(1)), 1, -1, None, 1,
                             commit_root=root)
    killed = dcp_trials.trial(stores, os.path.join(root, snapshot_id(2)), 2, 1,
                              "after its write", 2, commit_root=root)
    plain = dcp_trials.trial(stores, os.path.join(base, "plain"), 3, 1, "after its write", 3)
    return {"status": (first, killed, plain), "committed": dcp_trials.load_latest(root),
            "plain": dcp_trials.load(os.path.join(base, "plain")), "rank": dist.get_rank()}


def test_dcp_trials_kill_a_rank_of_dcp_save_and_the_commit_keeps_the_last_save(tmp_path):
    from labkit.checkpoint import dcp_trials
    world = labkit.world(2, teaching=False)
    stores = tmp_path / "stores"
    stores.mkdir()
    out = world.call(_dcp_round, (str(stores), str(tmp_path)), timeout=300)
    assert [o["status"][0] for o in out] == ["ok", "ok"]
    assert out[1]["status"][1] == "killed" and out[1]["status"][2] == "killed"
    assert dcp_trials.loaded([o["committed"] for o in out]) == [1.0]
    refused = dcp_trials.loaded([o["plain"] for o in out])
    assert isinstance(refused, str) and "Exception" in refused, refused
    with pytest.raises(ValueError, match="point must be one of"):
        dcp_trials.victim("x", 1, 0, 1, "y", 0, "while writing")


# ---- sections 1-2's crash trials (labkit.checkpoint.trials) -------------------------------------

_TRIAL_SAVES = variant('''
import os

import torch.distributed as dist
from labkit.checkpoint import layout, store, trials

SIZE = 70_000                                      # two os.write calls per shard


def protocol_save(run, root, step):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    sid = layout.snapshot_id(step)
    entry = run("writer", store.write_shard, root, sid, f"rank{rank}.bin",
                trials.payload(step, rank, SIZE))
    entries = [None] * world_size
    dist.all_gather_object(entries, entry)
    if rank == 0 and all(e is not None for e in entries):
        run("committer", store.commit, root, sid, entries, {"step": step})
    dist.barrier()


def write_in_place(root, step, rank):
    folder = os.path.join(root, layout.snapshot_id(step))
    os.makedirs(folder, exist_ok=True)
    fd = os.open(os.path.join(folder, f"rank{rank}.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    data = trials.payload(step, rank, SIZE)
    for start in range(0, len(data), 1 << 16):
        os.write(fd, data[start:start + (1 << 16)])
    os.close(fd)


def naive_save(run, root, step):                   # not atomic: no manifest, no agreement
    run("writer", write_in_place, root, step, dist.get_rank())
    dist.barrier()


def naive_one_process(root, step, ranks):
    for rank in range(ranks):
        write_in_place(root, step, rank)


def naive_load(root, ranks):
    for name in sorted(os.listdir(root), reverse=True):
        files = [os.path.join(root, name, f"rank{r}.bin") for r in range(ranks)]
        if all(os.path.isfile(f) for f in files):
            return int(name.split("-")[1]), {r: open(f, "rb").read() for r, f in enumerate(files)}
    return None


def every_call(victims, rng):
    return [(victim, {f"kill_{when}": k}) for victim, (calls, _) in sorted(victims.items())
            for k in range(1, calls + 1) for when in ("before", "after")]
''', {})


def test_trials_one_process_catch_a_save_that_is_not_atomic(tmp_path):
    """every_point's judge fails the naive save (a kill inside the last shard's writes leaves a
    folder with every file, one cut short) and passes the store's."""
    from labkit.checkpoint import trials
    ns = _TRIAL_SAVES
    with crash.Victims() as victims:
        names, rows = trials.every_point(victims, ns["naive_one_process"], ns["naive_load"], 2,
                                         ns["SIZE"], str(tmp_path))
        assert names == ["write"] * 4 and len(rows) == 8
        assert sum(is_torn for _, _, is_torn in rows) >= 2, rows
        def protocol(root, step, ranks):
            sid = layout.snapshot_id(step)
            entries = [store.write_shard(root, sid, f"rank{r}.bin", trials.payload(step, r, 100))
                       for r in range(ranks)]
            store.commit(root, sid, entries, {"step": step})
        names, rows = trials.every_point(victims, protocol, trials.load_store, 2, 100,
                                         str(tmp_path), when=("after",))
        assert not any(is_torn for _, _, is_torn in rows) and len(rows) == len(names)
        assert {step for _, step, _ in rows} == {1, 2}
    with pytest.raises(ValueError, match="before"):
        trials.every_point(None, None, None, 2, 1, str(tmp_path), when=("during",))


def test_trials_on_ranks_catch_a_save_that_is_not_atomic(tmp_path):
    """The harness of section 2 on real ranks: the naive distributed save is torn on every rank
    in some trial, the protocol never, and every rank loads the same step in every trial."""
    from labkit.checkpoint import trials
    ns, world = _TRIAL_SAVES, labkit.world(2, teaching=False)
    naive = world.call(trials.distributed, (ns["naive_save"], ns["naive_load"],
                                            str(tmp_path / "naive"), ns["SIZE"], ns["every_call"],
                                            0), timeout=120)
    assert trials.totals(naive)["torn"] > 0 and all(any(r["torn"] for r in rs) for rs in naive)
    assert trials.phase_table(naive)["writer: while writing its shard"][1] > 0
    good = world.call(trials.distributed, (ns["protocol_save"], trials.load_store,
                                           str(tmp_path / "good"), ns["SIZE"], ns["every_call"],
                                           0), timeout=120)
    assert trials.totals(good) == {"torn": 0, "missed": 0, "agree": True}
    assert {r["victim"] for r in good[0]} >= {("writer", 0), ("writer", 1), ("committer", 0)}
    assert all(r["status"] == "killed" for r in good[0] if r["mine"] and r["victim"][0] ==
               "committer")
    rows, restarts = trials.real_ranks(world, ns["protocol_save"], trials.load_store,
                                       str(tmp_path / "real"), 2, ns["SIZE"], ns["every_call"], 1)
    assert restarts == sum(row[1].endswith("killed") for row in rows) and restarts >= 1, rows
    assert all(row[2] == row[3] and not row[4] for row in rows), rows
    with pytest.raises(Exception, match="victim"):
        world.call(trials.distributed, (ns["protocol_save"], trials.load_store,
                                        str(tmp_path / "bad"), 10, lambda v, rng: [(("x", 0), {})],
                                        0), timeout=60)

"""Chapter 9 / lab 9: labkit.faults's rules and benches, the lab's reference answers used the way a
cluster's tooling uses them, and the lab's checkers rejecting the wrong answers issue 19 names (a
diagnoser that always names the slowest rank, a guard that never fires, a guard that fires on
ordinary noise, a validator that accepts another tokenizer), on real ranks."""
import copy
import math
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import labkit
from lab_notebooks import answer_cells
from labkit import checks as lab_checks
from labkit.faults import checks, checks_resume, detect, elastic, hang, spikes, traces

ROOT = Path(__file__).resolve().parents[2]
LAB = "lab09_failures_at_scale"
SOLUTION = ROOT / "solutions" / LAB / f"{LAB}.ipynb"
FEW = settings(max_examples=25, derandomize=True, deadline=None, database=None,
               suppress_health_check=list(HealthCheck))


def _answer_cells() -> dict:
    """Every answer cell of the lab's solution notebook, executed in one namespace."""
    return answer_cells(LAB, torch=torch, labkit=labkit, detect=detect, spikes=spikes,
                        traces=traces, copy=copy, math=math)


REF = _answer_cells()


@pytest.fixture(scope="module", autouse=True)
def _close_worlds():
    yield
    labkit.shutdown_all()


# ---- detect: the rules, one process -----------------------------------------------------------

def test_robust_z_matches_iglewicz_hoaglin_and_ignores_one_outlier():
    values = [10.0, 11.0, 9.0, 10.0, 100.0]
    z = detect.robust_z(values)                      # median 10, MAD 1
    assert z == pytest.approx([0.0, 0.6745, -0.6745, 0.0, 0.6745 * 90])
    assert detect.robust_z([3.0, 3.0, 3.0, 5.0]) == [0.0, 0.0, 0.0, math.inf]


def test_across_rank_mad_is_degenerate_at_two_ranks_and_the_pooled_noise_is_not():
    # at P = 2 the MAD of two medians is half their gap: every z is +-0.6745 whatever the gap
    for gap in (0.001, 1.0, 100.0):
        assert detect.robust_z([1.0, 1.0 + gap]) == pytest.approx([-0.6745, 0.6745])
    steady = [[0.005 + 0.0001 * (s % 3) for s in range(12)] for _ in range(2)]
    slow = [row[:] for row in steady]
    slow[1] = [t + 0.1 for t in slow[1]]
    assert detect.stragglers(steady) == [] and detect.stragglers(slow) == [1]


@FEW
@given(st.integers(2, 8), st.integers(6, 20), st.integers(0, 10_000), st.data())
def test_a_delay_far_above_noise_is_found_and_jitter_with_pauses_is_not(P, S, seed, data):
    gen = torch.Generator().manual_seed(seed)
    base = 0.005 * (1 + 0.3 * torch.rand(P, S, generator=gen, dtype=torch.float64))   # [P, S]
    healthy = base.tolist()
    for _ in range(data.draw(st.integers(0, 2))):                  # one-off pauses
        healthy[data.draw(st.integers(0, P - 1))][data.draw(st.integers(0, S - 1))] += 0.3
    assert detect.stragglers(healthy) == []
    slow_rank = data.draw(st.integers(0, P - 1))
    delayed = [row[:] for row in base.tolist()]
    delayed[slow_rank] = [t + 0.15 for t in delayed[slow_rank]]
    assert detect.stragglers(delayed) == [slow_rank]
    # the source material's rule, on means, fires on the pauses
    if healthy != base.tolist():
        assert detect.stragglers_relative(healthy)


def test_window_spike_waits_for_a_baseline_counts_non_finite_and_uses_the_factor():
    history = [1.0] * 9
    assert not detect.window_spike(history, 100.0)                 # 9 < min_history
    assert detect.window_spike(history, float("nan")) and detect.window_spike([], math.inf)
    history.append(1.0)
    assert detect.window_spike(history, 5.01) and not detect.window_spike(history, 4.99)
    recent = [100.0] * 10 + [1.0] * 100
    assert detect.window_spike(recent, 6.0)                        # the window: the last 100
    assert not detect.window_spike(recent, 6.0, window=110)        # mean 10: 6 is no spike


def test_hot_expert_and_imbalance_metrics():
    assert detect.hot_expert([100] * 8) is None
    assert detect.hot_expert([50, 60, 55, 611, 64, 66, 58, 48]) == 3
    assert detect.hot_expert([0, 0, 0]) is None


# ---- traces and the diagnoser on real ranks ---------------------------------------------------

def test_traces_of_real_ranks_show_the_straggler_in_compute_not_in_step_times():
    world = labkit.world(3, backend="gloo", teaching=False)
    trace = traces.record_run(world, steps=8, straggler=2, delay=0.1, seed=5, clock_skew=0.5)
    compute, wait = traces.compute_times(trace), traces.wait_times(trace)
    assert detect.stragglers(compute) == [2]
    assert detect.median(wait[0]) >= 0.09 and detect.median(wait[2]) < 0.05
    assert REF["diagnose"](trace) == {"straggler": 2, "missing": None, "hot_expert": None}


def test_diagnoser_reference_on_synthetic_traces_with_skewed_clocks():
    def rank(r, starts, computes, experts=None):
        collectives = [{"seq": s + 1, "op": "all_reduce", "step": s, "what": "grads",
                        "enter": t + c, "leave": t + c + 0.01}
                       for s, (t, c) in enumerate(zip(starts, computes))]
        ends = [t + c + 0.02 for t, c in zip(starts, computes)]
        return {"rank": r, "step_start": starts, "step_end": ends, "collectives": collectives,
                "expert_tokens": experts}
    starts = [i * 0.2 for i in range(10)]
    healthy = {"world_size": 2, "ranks": [rank(0, starts, [0.005] * 10),
                                          rank(1, [t + 1e4 for t in starts], [0.006] * 10)]}
    assert REF["diagnose"](healthy) == dict.fromkeys(("straggler", "missing", "hot_expert"))
    missing = copy.deepcopy(healthy)
    missing["ranks"][0]["collectives"][-1]["leave"] = None
    missing["ranks"][0]["step_end"][-1] = None
    missing["ranks"][1]["collectives"].pop()
    missing["ranks"][1]["step_end"][-1] = None
    assert REF["diagnose"](missing)["missing"] == 1


def test_checkers_accept_the_reference_and_reject_a_diagnoser_naming_the_slowest_rank():
    world = labkit.world(3, backend="gloo", teaching=False)
    checks.check_no_alarm(world, REF["diagnose"], seed=11)
    checks.check_missing(world, REF["diagnose"], seed=12)
    checks.check_hot_expert(world, REF["diagnose"], seed=13)

    def slowest(trace):
        out = REF["diagnose"](trace)
        compute = traces.compute_times(trace)
        totals = [sum(t for t in row if t is not None) for row in compute]
        out["straggler"] = max(range(len(totals)), key=totals.__getitem__)
        return out
    with pytest.raises(AssertionError, match="healthy run .*straggler"):
        checks.check_no_alarm(world, slowest, seed=14)

    def always_none(trace):
        return dict.fromkeys(("straggler", "missing", "hot_expert"))
    with pytest.raises(AssertionError, match="straggler = None, expected"):
        checks.check_straggler(world, always_none, seed=15)
    with pytest.raises(AssertionError, match="expected a dict"):
        checks.check_no_alarm(world, lambda trace: [None, None, None], seed=16)


def test_renamed_traces_move_the_fault_and_catch_a_detector_that_skips_rank_0():
    """Issue 26, class 4: each sensitivity check also judges its real trace with the ranks (the
    experts) renamed, so that every one of them is the faulty one once; a detector that never
    looks at rank 0, or names a constant expert, then fails whatever rank the run drew."""
    trace = traces.skew_clocks({"world_size": 3, "steps": 6, "ranks": [
        {"rank": r, "step_start": [s * 0.1 for s in range(6)],
         "step_end": [s * 0.1 + 0.05 for s in range(6)],
         "collectives": [{"seq": s + 1, "op": "all_reduce", "step": s, "what": "grads",
                          "enter": s * 0.1 + (0.04 if r == 1 else 0.004),
                          "leave": s * 0.1 + 0.045} for s in range(6)],
         "expert_tokens": [[10, 10, 50, 10] for _ in range(6)]} for r in range(3)]}, 0.5)
    assert REF["diagnose"](trace) == {"straggler": 1, "missing": None, "hot_expert": 2}
    for shift in (1, 2):
        assert REF["diagnose"](checks.relabel_ranks(trace, shift))["straggler"] == (1 + shift) % 3
        assert REF["diagnose"](checks.relabel_experts(trace, shift))["hot_expert"] == (2 + shift) % 4
    renamed = checks.relabel_ranks(trace, 2)
    assert [r["rank"] for r in renamed["ranks"]] == [0, 1, 2]
    assert renamed["ranks"][0]["step_start"] == trace["ranks"][1]["step_start"]   # its own clock

    def skips_rank_0(trace):                   # rank 0's record never read
        return REF["diagnose"](dict(trace, ranks=trace["ranks"][1:]))
    world = labkit.world(3, backend="gloo", teaching=False)
    with pytest.raises(AssertionError, match="missing = None, expected 0"):
        checks.check_missing(world, skips_rank_0, seed=12)     # on the run, or once renamed


# ---- the spike guard on real ranks ------------------------------------------------------------

class _NeverFires(REF["SpikeGuard"]):
    def after_step(self, step, batch_id, stats):
        return None


class _FiresOnNoise(REF["SpikeGuard"]):
    """The window rule with a factor of 1.5: hard batches (~1.5-2.3x) set it off."""

    def after_step(self, step, batch_id, stats):
        if detect.window_spike(self.history, stats["grad_norm"], factor=1.5):
            self.quarantined.add(batch_id)
            back, state, history = self.good
            spikes.restore(self.model, self.optimizer, state)
            self.history = list(history)
            return back
        return super().after_step(step, batch_id, stats)


class _SkipsWithoutRestore(REF["SpikeGuard"]):
    """Quarantines and repeats the step, but keeps the damaged weights."""

    def after_step(self, step, batch_id, stats):
        if detect.window_spike(self.history, stats["grad_norm"]):
            self.quarantined.add(batch_id)
            return step
        self.history.append(stats["grad_norm"])
        return None


def test_spike_guard_reference_and_the_named_wrong_guards():
    world = labkit.world(2, backend="gloo", teaching=False)
    got = checks.check_guard_spike(world, REF["SpikeGuard"], bad=2, snapshot_every=3, seed=21)
    assert all(len(r["rollbacks"]) == 2 for r in got)
    checks.check_guard_clean(world, REF["SpikeGuard"], snapshot_every=7, seed=22)
    with pytest.raises(AssertionError, match="quarantined \\[\\], the bad batches"):
        checks.check_guard_spike(world, _NeverFires, seed=23)
    with pytest.raises(AssertionError, match="on a clean stream your guard"):
        checks.check_guard_clean(world, _FiresOnNoise, seed=24)
    with pytest.raises(AssertionError, match="final weights differ"):
        checks.check_guard_spike(world, _SkipsWithoutRestore, seed=25)


def test_guarded_train_rejects_a_bad_resume_step_and_snapshots_restore_adamw_exactly():
    model = spikes.make_model(0)
    optimizer = spikes.make_optimizer(model)
    x, y = spikes.batch(0, 3, {})
    for _ in range(2):
        optimizer.zero_grad()
        spikes.forward_backward(model, x, y)
        optimizer.step()
    state = spikes.snapshot(model, optimizer)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.zero_grad()
    spikes.forward_backward(model, x, y)
    optimizer.step()
    spikes.restore(model, optimizer, state)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(s["step"] == 2 for s in optimizer.state_dict()["state"].values())

    class Backwards:
        def __init__(self, model, optimizer, **kwargs):
            self.quarantined = set()

        def after_step(self, step, batch_id, stats):
            return step + 1
    with pytest.raises(ValueError, match="expected None or the step to resume from"):
        spikes.guarded_train({"steps": 3}, Backwards)


def test_bad_batches_spike_the_gradient_norm_far_above_hard_ones():
    world = labkit.world(2, backend="gloo", teaching=False)
    plan = {"bad": [24], "hard": [12, 18, 30]}
    run = world.run(spikes.train, {"steps": 32, "plan": plan})[0]
    mean = sum(r["grad_norm"] for r in run[14:24] if r["kind"] == "clean") / 10
    assert run[24]["grad_norm"] > 8 * mean
    assert max(run[i]["grad_norm"] for i in (12, 18, 30)) < 3 * mean
    with pytest.raises(ValueError, match=r"global batch \(12\) is not divisible by the world "):
        spikes.batch(0, 0, {}, rank=0, size=5)


# ---- the resume validator ---------------------------------------------------------------------

@FEW
@given(st.integers(0, 100_000))
def test_validator_reference_plans_every_compatible_resume_and_refuses_every_mismatch(seed):
    case = lab_checks.Case("test", seed=seed)
    checks_resume.check_accepts(REF["validate_resume"], cases=2, seed=seed)
    for kind in checks_resume.WORDS:
        snap, run = checks_resume.mismatch(case, kind)
        with pytest.raises(ValueError):
            REF["validate_resume"](snap, run)


def test_checker_rejects_a_validator_that_accepts_another_tokenizer():
    def by_name(snapshot, run):
        if run["tokenizer"]["name"] != snapshot["tokenizer"]["name"] or \
                run["tokenizer"]["vocab_size"] != snapshot["tokenizer"]["vocab_size"]:
            raise ValueError("tokenizer")
        return REF["validate_resume"](dict(snapshot, tokenizer=run["tokenizer"]), run)
    checks_resume.check_accepts(by_name, seed=31)
    with pytest.raises(AssertionError, match="accepted a resume whose tokenizer"):
        checks_resume.check_refuses(by_name, kinds=("tokenizer",), seed=32)

    def vague(snapshot, run):
        try:
            return REF["validate_resume"](snapshot, run)
        except ValueError:
            raise ValueError("cannot resume") from None
    with pytest.raises(AssertionError, match="should name what differs"):
        checks_resume.check_refuses(vague, kinds=("cursor",), seed=33)

    def refuses_all(snapshot, run):                    # silence is not a check (class 3)
        raise ValueError("tokenizer, cursor or world size: cannot resume")
    with pytest.raises(AssertionError, match="refused a compatible resume"):
        checks_resume.check_refuses(refuses_all, kinds=("cursor",), seed=34)


# ---- hangs, torchrun ---------------------------------------------------------------------------

def test_py_spy_dumps_a_rank_and_the_verdict_needs_two_samples():
    world = labkit.world(2, backend="gloo", teaching=False)
    dump = hang.py_spy_dump(world.rank_pids()[1])
    assert "MainThread" in dump and hang.main_thread_frames(dump), dump[:500]
    waiting = {"dumps": {0: "Thread 1 (idle): \"MainThread\"\n    all_reduce "
                            "(torch/distributed/distributed_c10d.py:3252)\n"}}
    with pytest.raises(ValueError, match="one sample cannot tell"):
        hang.verdict([dict(waiting, beats=[1, 1])])
    assert hang.verdict([dict(waiting, beats=[1, 1]), dict(waiting, beats=[1, 1])]) == "deadlock"
    assert hang.verdict([dict(waiting, beats=[1, 1]), dict(waiting, beats=[2, 2])]) == "straggler"


@FEW
@given(st.integers(1, 50), st.integers(1, 12))
def test_work_lost_is_the_completed_steps_since_the_last_snapshot(kill_at, every):
    lost = elastic.lost_steps(kill_at, every)
    last_snapshot = max(s for s in range(0, kill_at) if s % every == 0)
    assert lost == (kill_at - 1) - last_snapshot and 0 <= lost < every


def test_one_kill_per_attempt_and_the_work_each_failure_cost():
    """kill_at as a list (one step per attempt): the command carries it, a restart per kill; the
    steps each attempt loses are those it completed after the snapshot its successor resumed
    from (an attempt that dies at once loses none), read from the logs' events."""
    command = elastic.command(2, "/tmp/x", 10, 4, [7, 8, 5, 6])
    assert "--max-restarts=4" in command and command[-2] == "7,8,5,6"
    with pytest.raises(ValueError, match="or a list of them"):
        elastic.launch(2, steps=10, every=4, kill_at=[7, 11], folder="/tmp/never")
    events = []
    for attempt, (resumed, done) in enumerate([(0, range(1, 7)), (4, range(5, 8)), (4, ()),
                                               (4, [5]), (4, range(5, 11))]):
        events.append({"event": "start", "rank": 0, "attempt": attempt, "resumed_from": resumed})
        events += [{"event": "step", "rank": 0, "attempt": attempt, "step": s, "loss": 1.0}
                   for s in done]
    lost = elastic.redone_per_attempt(events)
    assert lost == {0: [5, 6], 1: [5, 6, 7], 2: [], 3: [5]}
    assert [len(lost[a]) for a in range(4)] == [elastic.lost_steps(k, 4) for k in (7, 8, 5, 6)]
    assert sum(map(len, lost.values())) / len(lost) == (4 - 1) / 2          # not tau / 2


# ---- what labkit and the chapter say about torch: read from the installed torch ---------------

def _torch_file(*parts) -> str:
    return Path(torch.__file__).parent.joinpath(*parts).read_text(encoding="utf-8")


def test_async_error_handling_levels_are_what_the_installed_torch_defines():
    """labkit.faults.gpu's table and chapter 9's text against ProcessGroupNCCL.hpp: the enum's
    names and numbers, what SHOULD_CLEAN_UP / SHOULD_TEAR_DOWN make of each, the default, and
    torchrun's value. Fails when torch redefines a level, whichever way round."""
    import json
    import re
    from labkit.faults import gpu
    header = _torch_file("include", "torch", "csrc", "distributed", "c10d", "ProcessGroupNCCL.hpp")
    enum = re.search(r"enum ErrorHandlingMode \{(.*?)\};", header, re.S)
    assert enum, "ProcessGroupNCCL.hpp has no enum ErrorHandlingMode: torch changed it"
    levels = {int(v): name for name, v in re.findall(r"(\w+)\s*=\s*(\d+)", enum.group(1))}
    assert {lvl: row[0] for lvl, row in gpu.ASYNC_ERROR_HANDLING.items()} == levels

    def macro(name):          # "#define NAME(a) (a != X && a != Y)": true unless a is X or Y
        body = re.search(rf"#define {name}\(a\) \((.*?)\)\n", header).group(1)
        terms = body.split(" && ")
        excluded = [re.fullmatch(r"a != (\w+)", t).group(1) for t in terms]
        return {lvl: levels[lvl] not in excluded for lvl in levels}

    clean_up, tear_down = macro("SHOULD_CLEAN_UP"), macro("SHOULD_TEAR_DOWN")
    for level, (name, aborts, ends, words) in gpu.ASYNC_ERROR_HANDLING.items():
        assert (aborts, ends) == (clean_up[level], tear_down[level]), \
            f"level {level} ({name}): torch says abort={clean_up[level]}, tear down=" \
            f"{tear_down[level]}; labkit says {aborts}, {ends}"
        assert ("aborts the communicators" in words) == aborts and \
            ("without aborting" in words or "does nothing" in words) == (not aborts)
        assert ("tears the process down" in words) == ends and \
            ("keeps the process" in words or "does nothing" in words) == (not ends)
    default = re.search(r"default value \((\d) - (\w+)\)", header)
    assert default and (int(default.group(1)), default.group(2)) == (
        gpu.ASYNC_ERROR_HANDLING_DEFAULT, levels[gpu.ASYNC_ERROR_HANDLING_DEFAULT])
    agent = _torch_file("distributed", "elastic", "agent", "server", "local_elastic_agent.py")
    assert re.search(r'"TORCH_NCCL_ASYNC_ERROR_HANDLING", str\((\d)\)', agent).group(1) == \
        str(gpu.TORCHRUN_ASYNC_ERROR_HANDLING)
    # the chapter's prose says the same, level by level
    notebook = json.loads((ROOT / "course" / "09_failures_at_scale.ipynb").read_text())
    prose = " ".join("".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "markdown")
    prose = re.sub(r"\s+", " ", prose.replace("*", ""))
    for level, (name, _, _, words) in gpu.ASYNC_ERROR_HANDLING.items():
        assert re.search(rf"{level} \(`{name}`[^)]*\) {re.escape(words)}", prose), \
            f"chapter 9 does not say '{level} (`{name}`) {words}'"
        assert gpu.error_handling(level).startswith(f"{level} ({name})")
    with pytest.raises(ValueError, match="one of"):
        gpu.error_handling(4)


def _chapter_text(markdown_only=True) -> str:
    import json
    notebook = json.loads((ROOT / "course" / "09_failures_at_scale.ipynb").read_text())
    return " ".join("".join(c["source"]) for c in notebook["cells"]
                    if c["cell_type"] == "markdown" or not markdown_only)


def test_every_nccl_variable_the_chapter_names_is_one_the_installed_torch_reads():
    """Each TORCH_NCCL_* name in chapter 9's prose is declared in the installed c10d headers
    (ProcessGroupNCCL.hpp, FlightRecorder.hpp) or, for the older spellings the headers no longer
    list, present in libtorch; the timeouts the chapter quotes are the headers' constants."""
    import re
    from datetime import timedelta
    from torch.distributed import constants
    text = re.sub(r"_\s*\n\s*", "_", _chapter_text())
    names = set(re.findall(r"TORCH_NCCL_[A-Z_]*[A-Z]", text))
    assert {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "TORCH_NCCL_ENABLE_MONITORING",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_PROPAGATE_ERROR"} <= names
    headers = _torch_file("include", "torch", "csrc", "distributed", "c10d", "ProcessGroupNCCL.hpp") \
        + _torch_file("include", "torch", "csrc", "distributed", "c10d", "FlightRecorder.hpp")
    missing = sorted(n for n in names if f'"{n}"' not in headers)
    if missing:
        library = Path(torch.__file__).parent.joinpath("lib", "libtorch_cpu.so").read_bytes()
        missing = [n for n in missing if n.encode() not in library]
    assert not missing, f"chapter 9 names variables torch 2.13 does not read: {missing}"
    process_group = _torch_file("include", "torch", "csrc", "distributed", "c10d", "ProcessGroup.hpp")
    nccl_ms = re.search(r"kProcessGroupNCCLDefaultTimeout =\s*std::chrono::milliseconds\(([\d *]+)\)",
                        headers).group(1)
    gloo_ms = re.search(r"kProcessGroupDefaultTimeout =\s*std::chrono::milliseconds\(([\d *]+)\)",
                        process_group).group(1)
    assert eval(nccl_ms) == 10 * 60 * 1000 and eval(gloo_ms) == 30 * 60 * 1000
    assert constants.default_pg_timeout == timedelta(minutes=30)
    flat = re.sub(r"\s+", " ", text)
    assert "NCCL: 10 min (`kProcessGroupNCCLDefaultTimeout`" in flat
    assert "30 min (`kProcessGroupDefaultTimeout`" in flat
    recorder = _torch_file("include", "torch", "csrc", "distributed", "c10d", "FlightRecorder.hpp")
    entries = re.search(r'\{"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"\}, (\d+)\)',
                        recorder).group(1)
    assert f"the last {int(entries):,} entries unless `TORCH_FR_BUFFER_SIZE`" in flat


def test_a_locally_synchronised_group_is_named_by_its_ranks_and_the_groups_a_process_has():
    """Chapter 9's reason why the rejoin group cannot use use_local_synchronization=True: torch
    hashes the ranks with len(_world.pg_names), so processes that built different numbers of
    groups compute different names for the same ranks."""
    import inspect
    from torch.distributed import distributed_c10d as c10d
    source = inspect.getsource(c10d._hash_ranks_to_str)
    assert "len(_world.pg_names)" in source
    assert "use_hashed_name=use_local_synchronization" in inspect.getsource(c10d._new_group_with_tag)
    assert "`_hash_ranks_to_str`" in _chapter_text() and "len(_world.pg_names)" in _chapter_text()

def test_the_torchrun_command_restarts_and_isolates_the_store():
    command = elastic.command(2, "/tmp/x", 10, 4, 7)
    assert "--max-restarts=1" in command and "labkit.faults.elastic:train" in command
    with pytest.raises(ValueError, match="kill_at must be a step"):
        elastic.launch(2, steps=5, every=2, kill_at=9, folder="/tmp/never")


# ---- issue 24: the guard's rank holds no plan (new tests only) --------------------------------

class _ReadsThePlan(REF["SpikeGuard"]):
    """Issue 24's attack: walks up its stack and through every module for the list of bad ids,
    and rolls back on those ids without looking at a statistic."""

    def _bad_ids(self):
        import gc
        import sys
        found = set()
        frame = sys._getframe()
        while frame is not None:
            for value in list(frame.f_locals.values()):
                if isinstance(value, dict):
                    plan = value.get("plan", value)
                    if isinstance(plan, dict) and isinstance(plan.get("bad"), (list, tuple)):
                        found.update(plan["bad"])
                    if isinstance(value.get("removed"), (list, tuple, set)):
                        found.update(value["removed"])
            frame = frame.f_back
        for obj in gc.get_objects():
            if isinstance(obj, dict) and isinstance(obj.get("bad"), list) and "hard" in obj:
                found.update(obj["bad"])
        return found

    def after_step(self, step, batch_id, stats):
        if batch_id in self._bad_ids():
            self.quarantined.add(batch_id)
            back, state, history = self.good
            spikes.restore(self.model, self.optimizer, state)
            self.history = list(history)
            return back
        self.history.append(stats["grad_norm"])
        if (step + 1) % self.snapshot_every == 0:
            self.good = (step + 1, spikes.snapshot(self.model, self.optimizer),
                         list(self.history))
        return None


def _finds_nothing(share, guard_class):
    """On a rank: what the attack's search finds in the loop's stack (the share as handed)."""
    guard = guard_class(spikes.make_model(0), spikes.make_optimizer(spikes.make_model(0)))
    return sorted(guard._bad_ids())


def test_a_guard_that_reads_the_plan_from_its_stack_finds_none_on_the_rank():
    world = labkit.world(2, backend="gloo", teaching=False)
    plan = {"bad": [17], "hard": [4, 9]}
    shares = checks.stream_shares(5, 20, plan, world.size)
    assert all(set(share) == {"steps", "seed", "tokens"} for share in shares)
    assert world.run_each(_finds_nothing, shares, _ReadsThePlan) == [[], []]
    # the same search on spikes.guarded_train's frames (the old rank program) finds the plan:
    # the attack is real, and check_guard_spike no longer runs it
    found = []

    class Spy(_ReadsThePlan):
        def after_step(self, step, batch_id, stats):
            found.append(sorted(self._bad_ids()))
            return None
    spikes.guarded_train({"steps": 2, "seed": 0, "plan": plan}, Spy)
    assert found[0] == [17]
    with pytest.raises(AssertionError, match="quarantined \\[\\], the bad batches"):
        checks.check_guard_spike(world, _ReadsThePlan, seed=41)


def test_guarded_stream_is_guarded_train_on_the_same_batches():
    world = labkit.world(2, backend="gloo", teaching=False)
    plan = {"bad": [16], "hard": [5, 11]}
    config = {"steps": 24, "seed": 7, "plan": plan}
    old = world.call(spikes.guarded_train, args=(config, REF["SpikeGuard"]))
    new = world.run_each(checks.guarded_stream, checks.stream_shares(7, 24, plan, 2),
                         REF["SpikeGuard"])
    for a, b in zip(old, new):
        assert torch.equal(a["weights"], b["weights"])
        assert (a["rollbacks"], a["quarantined"]) == (b["rollbacks"], b["quarantined"]) \
            and a["quarantined"] == [16]


# ---- issue 26: every test cell of lab 9 has a wrong answer that fails exactly it --------------
# The lab's own test cells (visible and hidden lines) run outside nbgrader (lab_notebooks.run_lab)
# against the solution with one answer cell replaced by text replacements of its source.

import lab_notebooks                                                    # noqa: E402

TASK1_CELLS = ["test_task1_no_alarm", "test_task1_straggler", "test_task1_missing",
               "test_task1_hot_expert"]
TASK2_CELLS = ["test_task2_clean_stream", "test_task2_spike_rolled_back"]
TASK3_CELLS = ["test_task3_accepts", "test_task3_refuses"]


def lab9_wrong(grade_id, *replacements):
    """The solution's answer cell `grade_id` with (old, new) replacements (each must occur)."""
    source = lab_notebooks.answer(LAB, grade_id)
    for old, new in replacements:
        assert old in source, f"{old!r} not in the reference answer of {grade_id}"
        source = source.replace(old, new)
    return {grade_id: source}


def _graded(grade_id, name):
    """The solution's answer cell `grade_id` made wrong by the graded wrong answer `name`."""
    wrong = getattr(lab_notebooks.wrong_answers(LAB), name)
    return {grade_id: wrong(lab_notebooks.answer(LAB, grade_id))}


DIAGNOSE_RETURN = '    return {"straggler": straggler, "missing": missing, "hot_expert": hot}'
NEVER_FIRES_DIAGNOSE = [(DIAGNOSE_RETURN,
                         '    return {"straggler": None, "missing": None, "hot_expert": None}')]
SNAPSHOT_STEP = ("        self.history.append(norm)\n"
                 "        if (step + 1) % self.snapshot_every == 0:     # the state after a normal "
                 "step\n")
WRONG_LAB9 = {
    # name: (answers, the cells it must fail)
    "calls the busiest expert hot, however even the routing": (
        lab9_wrong("task1_diagnose", ("hot = detect.hot_expert(total)",
                                      "hot = detect.hot_expert(total, ratio=1.0)")),
        {"test_task1_no_alarm"}),
    # the graded ones (tests/grading/wrong_answers/lab09_failures_at_scale.py), each alone
    "the straggler rule on step times (every rank waits for the slowest)": (
        _graded("task1_diagnose", "straggler_by_step_time"), {"test_task1_straggler"}),
    "names a rank that hangs in the collective, not the one that never came": (
        _graded("task1_diagnose", "missing_is_the_stuck"), {"test_task1_missing"}),
    "hot only above half the tokens (the text says 40-60%)": (
        _graded("task1_diagnose", "hot_over_half"), {"test_task1_hot_expert"}),
    "redoes every step above 1.5x once, in case it was transient": (
        _graded("task2_spike_guard", "retries_moderate_rises"), {"test_task2_clean_stream"}),
    "never fires at all (no false alarm, no use)": (
        lab9_wrong("task1_diagnose", *NEVER_FIRES_DIAGNOSE), set(TASK1_CELLS)),
    "snapshots before checking the step (a spike on the schedule is saved)": (
        lab9_wrong("task2_spike_guard",
                   ("        norm = stats[\"grad_norm\"]\n",
                    "        norm = stats[\"grad_norm\"]\n"
                    "        if (step + 1) % self.snapshot_every == 0:\n"
                    "            self.good = (step + 1, spikes.snapshot(self.model, "
                    "self.optimizer), list(self.history))\n"),
                   (SNAPSHOT_STEP, "        self.history.append(norm)\n        if False:\n")),
        {"test_task2_spike_rolled_back"}),
    "never fires (a clean stream is all it passes)": (
        lab9_wrong("task2_spike_guard", ("        norm = stats[\"grad_norm\"]\n",
                                         "        return None\n")), set(TASK2_CELLS)),
    "per-rank batch from the old world size": (
        lab9_wrong("task3_validate_resume", ('"per_rank_batch": B // size',
                                             '"per_rank_batch": B // old_size')),
        {"test_task3_accepts"}),
    "compares the tokenizer's name and size, not its hash": (
        lab9_wrong("task3_validate_resume", ('if run["tokenizer"] != snapshot["tokenizer"]:',
                                             'if (run["tokenizer"]["name"], run["tokenizer"]['
                                             '"vocab_size"]) != (snapshot["tokenizer"]["name"], '
                                             'snapshot["tokenizer"]["vocab_size"]):')),
        {"test_task3_refuses"}),
    "refuses everything (names every field)": (
        lab9_wrong("task3_validate_resume", ('    step, B, old_size = snapshot["step"]',
                                             '    raise ValueError("tokenizer, data mixture, seed, '
                                             'cursor, global batch and world size checked")\n'
                                             '    step, B, old_size = snapshot["step"]')),
        set(TASK3_CELLS)),
}


def _lab9_cells(answers):
    task = next(iter(answers))
    return {"task1_diagnose": TASK1_CELLS, "task2_spike_guard": TASK2_CELLS,
            "task3_validate_resume": TASK3_CELLS}[task]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", WRONG_LAB9)
def test_each_wrong_answer_fails_exactly_its_cells(name):
    answers, expected = WRONG_LAB9[name]
    outcome = lab_notebooks.run_lab(LAB, _lab9_cells(answers), answers)
    failed = {cell for cell, error in outcome.items() if error is not None}
    assert failed == expected, {cell: repr(error)[:300] for cell, error in outcome.items()}


def test_every_test_cell_of_lab9_is_failed_alone_by_some_wrong_answer():
    alone = {next(iter(cells)) for _, cells in WRONG_LAB9.values() if len(cells) == 1}
    assert alone == set(TASK1_CELLS + TASK2_CELLS + TASK3_CELLS)

"""Lab 8's graded wrong answers (issue 26). Each function takes an answer cell's solution source and
returns the wrong one; tests/chapters/test_ch08_checkpoints.py runs each of them through the same
checkers the test cells call and asserts the checks it fails:

    removes_nothing        task 1  loses all three task 1 cells (10), test_task1_crash_trials
                                   included: a collect that returns at once tears nothing, and
                                   earned the crash cell's 3 before (class 3)
    shards_first           task 1  loses test_task1_crash_trials (3): the shards removed before
                                   the manifest (a kill in between leaves a torn snapshot
                                   published)
    replays_from_zero      task 2  loses test_task2_same_world_size (3): at the same world size,
                                   restore replays the training from step 0
    own_range_only         task 2  loses test_task2_other_world_size (3): each rank takes its old
                                   rank's moments, whatever the new layout
    one_buffer_set         task 3  loses test_task3_double_buffer (3): one set of host buffers
                                   (the copy cell holds: the window of class 8 is closed)
    copies_in_the_writer   task 3  loses test_task3_copy_then_write (3): the copy is made by the
                                   writer thread, after the next training step changed the tensors
    durable_at_the_copy    task 4  loses test_task4_simulate (3): a snapshot counted durable when
                                   its copy ends, not when its write does
    write_never_matters    task 4  loses test_task4_interval (2): sqrt(2 stall M) whatever the write
    unverified_and_leases  task 1  loses test_task1_retention (4) and test_task1_leases (3), keeps
                                   test_task1_crash_trials: two mistakes in one collect, each of
                                   which the chapter test runs alone (UNVERIFIED: the newest
                                   `keep` published snapshots kept, none verified, so a flipped
                                   byte or a cut shard stays and a good older one goes;
                                   IGNORES_LEASES: a reader's lease protects nothing)

Three submissions of 27 points (one wrong answer per task each)."""
from wrong_answers import edit


POINTS = 27


def removes_nothing(source: str) -> str:
    return edit(source, "    names = sorted(os.listdir(folder))\n",
                    "    return []\n    names = sorted(os.listdir(folder))\n")


def shards_first(source: str) -> str:
    return edit(source, "    for sid in gone:                                 # 1. unpublish: "
                            "no loader can pick it now\n",
                    "    for sid in gone:\n"
                    "        shutil.rmtree(os.path.join(folder, sid), ignore_errors=True)\n")


def replays_from_zero(source: str) -> str:
    return edit(source, '    old = FlatLayout.from_dict(parts[0]["layout"])\n',
                    '    if len(parts) == trainer.world_size:           # replay: same run\n'
                    '        trainer.train(parts[0]["steps"])\n        return\n'
                    '    old = FlatLayout.from_dict(parts[0]["layout"])\n')


def own_range_only(source: str) -> str:
    return edit(source, "getattr(opt, name).copy_(flat[start:end])",
                    "getattr(opt, name).copy_(parts[trainer.rank][name])")


def one_buffer_set(source: str) -> str:
    return edit(source, "self.free = [0, 1]", "self.free = [0]")


def copies_in_the_writer(source: str) -> str:
    source = edit(source, "        for key in state:                    # the copy: the next "
                              "step may change the tensors\n"
                              "            target[key].copy_(state[key])\n",
                      "        self.live = state\n")
    return edit(source, "                self.write(step, self.sets[index])",
                    "                for key in self.live:\n"
                    "                    self.sets[index][key].copy_(self.live[key])\n"
                    "                self.write(step, self.sets[index])")


def durable_at_the_copy(source: str) -> str:
    return edit(source, "                    pending, since = (t + write, done), 0.0",
                    "                    pending, since = (t, done), 0.0")


def write_never_matters(source: str) -> str:
    return edit(source, "    return max(write, math.sqrt(2 * stall * mtbf))",
                    "    return math.sqrt(2 * stall * mtbf)")


# (old, new) edits of task 1's solution, shared with tests/chapters/test_ch08_checkpoints.py
UNVERIFIED = ("            store.verify(folder, sid)                # sizes and SHA-256 of every "
              "shard", "            pass                                     # published = good")
IGNORES_LEASES = ("    kept = set(verified[-keep:]) | leased", "    kept = set(verified[-keep:])")


def unverified_and_leases(source: str) -> str:
    return edit(edit(source, *UNVERIFIED), *IGNORES_LEASES)


WRONG = {
    "wrong_task1_nothing_task2_replay_task3_one_set_task4_young": (
        {"task1_collect": removes_nothing, "task2_zero1_resume": replays_from_zero,
         "task3_async_checkpointer": one_buffer_set, "task4_interval": write_never_matters},
        None, POINTS - 10 - 3 - 3 - 2),
    "wrong_task1_shards_first_task2_own_range_task3_late_copy_task4_at_copy": (
        {"task1_collect": shards_first, "task2_zero1_resume": own_range_only,
         "task3_async_checkpointer": copies_in_the_writer, "task4_interval": durable_at_the_copy},
        None, POINTS - 3 - 3 - 3 - 3),
    "wrong_task1_unverified_no_leases": ({"task1_collect": unverified_and_leases}, None,
                                         POINTS - 4 - 3),
}

# the test cells no graded wrong answer of this module fails yet (test_labs checks it exactly)
UNCOVERED = []

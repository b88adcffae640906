"""Lab 3's graded wrong answers (issues 26 and 28), three submissions of one wrong answer per task.

"global_and_one_moment" (5 of 12):
- task 1, test_task1_sharded_optimizer (4): plain data parallelism whose full optimizer is kept in
  a module global, with a sharded decoy on the instance (the state used to be counted only where
  reachable from the instance; now every optimizer stepped on the rank counts);
- task 2, test_task2_peak_moment (1): the bytes and the peak right, the moment always "backward"
  (test_task2_predict_memory passes);
- task 3, test_task3_one_f_one_b (2): every pipeline stage holds as many microbatches as the first
  (right under GPipe, where every stage holds m: test_task3_gpipe passes).
"world_size_and_fudge" (4 of 12):
- task 1, test_task1_sharded_optimizer (4): P read from the notebook's WORLD_SIZE (= 4) instead
  of dist.get_world_size() (the hidden tests also run at P = 3);
- task 2, test_task2_predict_memory (3): backward's worst moment taken as the last block's
  gelu_backward only, the loss's backward and the reduce-scatter's sum left out (1.4-3.1% low
  where they win, stages 2-3; the moment stays right: test_task2_peak_moment passes);
- task 3, test_task3_gpipe (1): under reshard="step" the full gradients counted from the first
  forward instead of the first backward (the same peak under 1F1B with m >= pp + 1, where the peak
  reading has both: test_task3_one_f_one_b passes; too high under GPipe).
"duplicates_per_group" (11 of 12):
- task 1, test_task1_bad_inputs (1): the set of parameters seen is started afresh in every group,
  so a parameter passed twice in one group is refused but one in two groups is accepted (and
  would be stepped twice); the optimizer itself is right (test_task1_sharded_optimizer passes).
The per-cell coverage (each mistake alone) is in tests/chapters/test_lab03_memory.py (tasks 2-3)
and tests/chapters/test_ch03_memory_and_zero.py (task 1)."""
from wrong_answers import swap


_GLOBAL_FULL_OPTIMIZER = '''
_Sharded = ShardedOptimizer
_FULL = []                                   # the real optimizer, out of the instance's reach


class ShardedOptimizer(_Sharded):
    def __init__(self, params, optimizer_cls, **kwargs):
        groups = list(params)
        super().__init__(groups, optimizer_cls, **kwargs)
        whole = [dict(g) for g in groups] if isinstance(groups[0], dict) else groups
        _FULL.append(optimizer_cls(whole, **kwargs))
        self.full = len(_FULL) - 1

    @torch.no_grad()
    def step(self):
        for p, piece, chunk, _ in self.entries:
            if p.grad is None:
                piece.grad = None
                continue
            dist.all_reduce(p.grad)
            p.grad /= self.world_size
            start = min(self.rank * chunk, p.numel())
            piece.grad = p.grad.reshape(-1)[start:start + piece.numel()].clone()
        self.optimizer.step()                # the decoy: this rank's slices
        _FULL[self.full].step()              # the values: every parameter, whole
'''

_MOMENT = 'moment="backward" if backward > optimizer_step else "optimizer step"'
# backward's worst moment: the last block's gelu_backward only
_WORST = ("    if stage >= 2:   # the reduce-scatter's sum [S], with grad_out, grad_pre and grad_x alive\n"
          "        worst.append((1 + 4 + 1) * b * tokens_h + s * b)\n"
          "    backward = activations + 8 + max(worst)\n",
          "    backward = activations + 8 + worst[1]\n")
# every stage's schedule read as the first stage's
_EVERY_STAGE_FIRST = ('zero_pipeline.schedule(case["schedule"], pp, stage, m)',
                      'zero_pipeline.schedule(case["schedule"], pp, 0, m)')
# the step policy's full gradients from the first forward
_GRADIENTS_FROM_FORWARD = ("                if backwards:\n"
                           "                    held += L * n * b                         # full gradients from the first backward\n",
                           "                held += L * n * b                             # full gradients\n")


# the duplicate check per group instead of over the whole call
DUPLICATES_PER_GROUP = swap(("        for group in groups:\n            members = group[\"params\"]\n",
                             "        for group in groups:\n            seen = set()        "
                             "# parameters of this group\n            members = group[\"params\"]\n"))


WRONG = {
    "global_and_one_moment": ({
        "task1_sharded_optimizer": lambda source: source + "\n" + _GLOBAL_FULL_OPTIMIZER,
        "task2_predict_memory": swap((_MOMENT, 'moment="backward"')),
        "task3_pipeline_peaks": swap(_EVERY_STAGE_FIRST),
    }, None, 5),
    "world_size_and_fudge": ({
        "task1_sharded_optimizer": swap(("dist.get_rank(), dist.get_world_size()",
                                             "dist.get_rank(), WORLD_SIZE")),
        "task2_predict_memory": swap(_WORST),
        "task3_pipeline_peaks": swap(_GRADIENTS_FROM_FORWARD),
    }, None, 4),
    "duplicates_per_group": ({"task1_sharded_optimizer": DUPLICATES_PER_GROUP}, None, 11),
}

# the test cells no graded wrong answer of this module fails yet (test_labs checks it exactly)
UNCOVERED = []

"""Lab 3's graded wrong answers (issue 26), three submissions of one wrong answer per task.

"global_and_one_moment" (1 of 12):
- task 1, test_task1_sharded_optimizer (4): plain data parallelism whose full optimizer is kept in
  a module global, with a sharded decoy on the instance (the state used to be counted only where
  reachable from the instance; now every optimizer stepped on the rank counts);
- task 2, test_task2_predict_memory (4): the peak as the start of backward only (the optimizer
  step's moment ignored: within 10% on every old config, 27% low on stage 0, one block, 4 tokens);
- task 3, test_task3_predict_collectives (3): reshard_after_forward ignored.
"world_size_and_fudge" (4 of 12):
- task 1, test_task1_sharded_optimizer (4): P read from the notebook's WORLD_SIZE (= 4) instead
  of dist.get_world_size() (the old hidden tests ran at P = 4 only; now also P = 3);
- task 2, test_task2_predict_memory (4): the peak as a flat 1.2 x (kept + activations) (within
  10% on the old configs, one bench shape; 28-31% low on the new ones).
"duplicates_per_group" (11 of 12):
- task 1, test_task1_bad_inputs (1): the set of parameters seen is started afresh in every group,
  so a parameter passed twice in one group is refused but one in two groups is accepted (and
  would be stepped twice); the optimizer itself is right (test_task1_sharded_optimizer passes).
The per-cell coverage (bad inputs, padding, a rank holding nothing) is in
tests/chapters/test_ch03_memory_and_zero.py."""
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

_PEAK = "    peak = sum(kept.values()) + max(activations + backward, optimizer_step)\n"


# the duplicate check per group instead of over the whole call
DUPLICATES_PER_GROUP = swap(("        for group in groups:\n            members = group[\"params\"]\n",
                             "        for group in groups:\n            seen = set()        "
                             "# parameters of this group\n            members = group[\"params\"]\n"))


WRONG = {
    "global_and_one_moment": ({
        "task1_sharded_optimizer": lambda source: source + "\n" + _GLOBAL_FULL_OPTIMIZER,
        "task2_predict_memory": swap((_PEAK, "    peak = sum(kept.values()) + activations + backward\n")),
        "task3_predict_collectives": swap(("(2 if reshard_after_forward else 1) * m * L", "2 * m * L")),
    }, None, 1),
    "world_size_and_fudge": ({
        "task1_sharded_optimizer": swap(("dist.get_rank(), dist.get_world_size()",
                                             "dist.get_rank(), WORLD_SIZE")),
        "task2_predict_memory": swap((_PEAK, "    peak = 1.2 * (sum(kept.values()) + activations)\n")),
    }, None, 4),
    "duplicates_per_group": ({"task1_sharded_optimizer": DUPLICATES_PER_GROUP}, None, 11),
}

# the test cells no graded wrong answer of this module fails yet (test_labs checks it exactly)
UNCOVERED = []

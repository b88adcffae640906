"""Chapter 9: failures at scale: cause them on real ranks, diagnose them, recover from them.

    from labkit.faults import detect, traces, hang, elastic, spikes, matrix, gpu

| module | what | course section |
|---|---|---|
| `matrix` | rank programs for the fault matrix: exits, mismatched collectives, RNG under recomputation, an empty expert under DDP, crashes around a checkpoint's commit | 1 |
| `hang` | py-spy dumps of every rank, heartbeats, deadlock or straggler | 2 |
| `traces` | traces of real runs with injected delays, skipped collectives, a hot expert; compute, wait and step times | 2, 3; lab 9 |
| `detect` | the detection rules: robust z-scores (median, MAD), the relative rule, the spike window, the hot expert | 3, 5; drill |
| `elastic` | a job under torchrun --max-restarts: a rank SIGKILLed, restarted, resumed from chapter 8's checkpoint | 4 |
| `spikes` | the loss-spike bench (extreme tokens), training with defences, the loop that hosts lab 9's guard | 5; lab 9 |
| `gpu` | NCCL's debug output, the watchdog and the flight recorder on GPU runners; Xid codes | 6 |
| `selfcheck` | the chapter's check-yourself questions: answered first, judged here | 3, 4 |
| `checks`, `checks_guard`, `checks_resume`, `rates` | lab 9's checkers: fresh traces and streams recorded on ranks, the student's rule judged by its measured miss and false-alarm rates | lab 9 |

Chapter 8's pieces are imported, never copied: `labkit.checkpoint.store` (publication,
load_latest), `resume` (capture and strict restore), `bench` (the trainer). What is not here: the
diagnoser, the spike guard with rollback and the resume validator (lab 9, tasks 1-3).
"""

_SUBMODULES = ("detect", "traces", "hang", "elastic", "spikes", "matrix", "gpu", "checks",
               "checks_guard", "checks_resume", "rates", "selfcheck")


def __getattr__(name):
    if name in _SUBMODULES:
        import importlib
        return importlib.import_module(f"labkit.faults.{name}")
    raise AttributeError(f"module 'labkit.faults' has no attribute {name!r}")

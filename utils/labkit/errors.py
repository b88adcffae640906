"""The errors `labkit` raises in the kernel. Each names the rank and says what to check."""


class LabkitError(Exception):
    """Base class of every labkit error."""


class WorldError(LabkitError, ValueError):
    """The world cannot be built as asked (bad size, backend not available here)."""


class PicklingError(LabkitError, TypeError):
    """The function or an argument cannot be sent to the ranks."""


class RankError(LabkitError):
    """Code running on a rank raised.

    `rank` is the first rank that raised, `traceback` its traceback (your cell's lines included),
    `errors` maps every rank that raised to its traceback text, `kind` names the exception's class
    on that rank (`"ValueError"`) and `module` its module (`"builtins"`).
    """

    def __init__(self, message, rank, traceback, errors, kind=None, module=None):
        super().__init__(message)
        self.rank = rank
        self.traceback = traceback
        self.errors = errors
        self.kind = kind
        self.module = module


class RankDied(LabkitError):
    """A rank process ended without answering (hard exit, SIGKILL, segfault)."""

    def __init__(self, message, rank, exitcode):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode


class CallTimeout(LabkitError, TimeoutError):
    """A call ran past its timeout; `diagnosis` says where every rank was."""

    def __init__(self, message, diagnosis):
        super().__init__(message)
        self.diagnosis = diagnosis


class CallInterrupted(KeyboardInterrupt):
    """The kernel was interrupted during a call; `diagnosis` says where every rank was.

    A KeyboardInterrupt, so that notebook runners treat it as the interrupt it is.
    """

    def __init__(self, message, diagnosis):
        super().__init__(message)
        self.diagnosis = diagnosis

"""Run failures the CLI reports in one line. Kept free of heavy imports, so ``mmgrpo --help`` starts without torch."""


class RunError(RuntimeError):
    """A failure during a run that its one-line message explains (a reward that failed, data with no usable item
    left); the CLI prints the message without a traceback and exits 1."""

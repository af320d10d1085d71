"""Exception types that mark failures as the user's to fix (never retried) or as transient (worth a retry)."""


class DraftlineError(Exception):
    """Base of all draftline errors."""


# What every entry point prints after the traceback of an exception that is not a DraftlineError.
BUG_LINE = ("This is not a draftline error (those are one sentence naming what to fix): it is a bug in draftline or "
            "in a library it calls; the traceback shows where. Please report it with this output.")


def report_failure(exc: BaseException, bad_input: bool = False) -> int:
    """What an entry point prints on stderr for an exception, and its exit code. A draftline error: with
    `bad_input` (found before any stage ran) every line and 2, else its first line (the rest is a log tail) and 1.
    Anything else is a bug: its traceback, BUG_LINE and 3."""
    import sys
    import traceback

    if isinstance(exc, DraftlineError):
        lines = str(exc).splitlines() if bad_input else str(exc).splitlines()[:1]
        for line in lines:
            print(f"draftline: {line}", file=sys.stderr)
        return 2 if bad_input else 1
    traceback.print_exception(exc)
    print(f"draftline: {BUG_LINE}", file=sys.stderr)
    return 3


class ConfigError(DraftlineError, ValueError):
    """Bad input: a config, prompt file, model or drafter directory, or store URI. Retrying cannot help."""


class StoreError(DraftlineError):
    """The artifact store failed. `transient` says whether a retry may help (network) or not (credentials)."""

    def __init__(self, message: str, transient: bool = False):
        super().__init__(message)
        self.transient = transient


class IntegrityError(StoreError):
    """Stored bytes do not match their manifest entry (size or sha256)."""


class ShardWriteError(DraftlineError):
    """A shard could not be written (on a writer thread); names the shard and keeps the cause's `transient`."""

    def __init__(self, message: str, transient: bool = False):
        super().__init__(message)
        self.transient = transient


class TrainingError(DraftlineError):
    """Training processes failed (a rank died or raised). `transient` says whether a retry, which resumes from the
    last checkpoint, may help (a killed or crashed process) or not (the ranks refused their input)."""

    def __init__(self, message: str, log_tail: str = "", transient: bool = True):
        super().__init__(message + (f"\n--- training log (tail) ---\n{log_tail}" if log_tail else ""))
        self.log_tail = log_tail
        self.transient = transient


class EngineError(DraftlineError):
    """An engine server failed to load or to serve. `log_tail` holds its last output lines."""

    def __init__(self, message: str, log_tail: str = "", transient: bool = True):
        super().__init__(message + (f"\n--- engine log (tail) ---\n{log_tail}" if log_tail else ""))
        self.log_tail = log_tail
        self.transient = transient


def is_transient(exc: BaseException) -> bool:
    """True when a retry may succeed: engine loads and store network errors, never bad input."""
    if isinstance(exc, ConfigError):
        return False
    return bool(getattr(exc, "transient", False))

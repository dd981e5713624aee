"""Error types a user can act on. The CLI prints their message as one line and exits non-zero."""


class EagletrainError(Exception):
    """Expected, user-actionable failure (bad input, gate refused, lock held)."""

    exit_code = 2


class ConfigError(EagletrainError):
    """The config file or an override is invalid."""


class InputError(EagletrainError):
    """An input file (conversations, prompts, model) is missing or malformed."""


class GateError(EagletrainError):
    """A stage refused to start because the previous stage is not verified complete."""

    exit_code = 3


class LockHeldError(EagletrainError):
    """Another live worker owns this stage (or partition)."""

    exit_code = 4


class VerifyError(EagletrainError):
    """Verification found missing or corrupt items."""

    exit_code = 5


class DiskSpaceError(EagletrainError):
    """The output would not fit the free disk."""

    exit_code = 7

"""Errors the command line turns into one-line messages (never a traceback) and exit codes."""


class SpecCliError(Exception):
    """A runtime error the user can act on: bad file, unsupported model, prompt too long. Exit code 1."""

    exit_code = 1


class UsageError(SpecCliError):
    """A bad flag value or a bad combination of flags. Exit code 2."""

    exit_code = 2


class StateError(SpecCliError):
    """A saved state that cannot be restored (a slot file: corrupt, truncated, of another model, settings or version).
    Nothing is left half restored: the caller empties what it was restoring into. Exit code 1; the server's 400."""

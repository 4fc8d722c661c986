"""Errors the command line turns into one-line messages (never a traceback) and exit codes."""


class SpecCliError(Exception):
    """A runtime error the user can act on: bad file, unsupported model, prompt too long. Exit code 1."""

    exit_code = 1


class UsageError(SpecCliError):
    """A bad flag value or a bad combination of flags. Exit code 2."""

    exit_code = 2

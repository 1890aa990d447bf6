"""The base of every 'bad input' error: the CLI prints its one-line message, not a traceback.

Subclasses say what was wrong and what to do (a missing file, an undecodable image, a foreign
model file, a dataset folder laid out wrongly, no Java for the official metrics, ...).
"""


class UserError(Exception):
    """Bad input or environment; ``exit_code`` 2 for usage errors, 1 for failures."""

    exit_code = 1


class UsageError(UserError):
    """A bad command line or setting (an option out of range, a missing config file, an output
    that cannot be written or resumed): exit status 2, before any work is lost."""

    exit_code = 2

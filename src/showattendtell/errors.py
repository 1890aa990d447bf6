"""The base of every 'bad input' error: the CLI prints its one-line message, not a traceback.

Subclasses say what was wrong and what to do (a missing file, an undecodable image, a foreign
model file, a dataset folder laid out wrongly, no Java for the official metrics, ...).
"""


class UserError(Exception):
    """Bad input or environment; ``exit_code`` 2 for usage errors, 1 for failures."""

    exit_code = 1

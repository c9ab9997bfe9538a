"""The one exception type users see.

Anything that a user can fix (a bad path, a corrupt checkpoint, an option out of range) raises
`JaxserveError` with a message that names the value and says what to do. The CLI prints such
errors as one line, without a traceback; anything else is a bug and keeps its traceback.
"""


class JaxserveError(Exception):
    """An error caused by the user's input, with a message meant to be read by them."""


class CheckpointError(JaxserveError):
    """A model directory or file that cannot be loaded."""


class InputError(JaxserveError):
    """A prompt or request parameter that cannot be served."""

"""Argument checks with messages that say what was wrong and what is allowed,
and the `UserError` base class for problems a user must fix (no Keras: the
command line reads this module before it imports anything heavy)."""

import difflib
import numbers


class UserError(ValueError):
    """A problem with the user's input (data, arguments, run directory).

    Its message says what was wrong and what to do; the command line prints it
    as one line and exits with status 2.
    """


def check_positive_int(name, value):
    """Raises `ValueError` unless `value` is an integer > 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive integer; got {value!r}.")


def check_rate(name, value):
    """Raises `ValueError` unless `value` is a probability in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < 1:
        raise ValueError(f"{name} must be a number in [0, 1); got {value!r}.")


def check_choice(name, value, choices):
    """Raises `ValueError` unless `value` is one of `choices`."""
    if value not in choices:
        close = difflib.get_close_matches(str(value), [str(choice) for choice in choices], 1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"{name} must be one of {list(choices)}; got {value!r}{hint}.")

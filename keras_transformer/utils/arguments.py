"""Values of command-line options: parsers for argparse that also check values given in Python.

`positive_int("3")` parses an option's text (argparse's `type=`, raising
`argparse.ArgumentTypeError` with one line); `positive_int.accepts(3)` checks
a value that came from Python instead (`TrainingOptions` built by hand).
"""

import argparse
import ast
import math


class Number:
    """A finite `kind` (int or float) above `lowest`, or equal to it if `inclusive`."""

    def __init__(self, kind, lowest, inclusive, description):
        self.kind, self.lowest, self.inclusive = kind, lowest, inclusive
        self.description = description

    def accepts(self, value):
        """Whether a Python value is such a number (an int for a float too; never a bool)."""
        kinds = (int,) if self.kind is int else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
            return False
        return value >= self.lowest if self.inclusive else value > self.lowest

    def __call__(self, text):
        try:
            value = self.kind(text)
        except ValueError:
            value = None
        if value is None or not self.accepts(value):
            raise argparse.ArgumentTypeError(f"expected {self.description}, got {text!r}")
        return value

    def __repr__(self):
        return f"Number({self.description!r})"


positive_int = Number(int, 0, False, "a positive integer")
non_negative_int = Number(int, 0, True, "an integer >= 0")
positive_float = Number(float, 0, False, "a number > 0")
non_negative_float = Number(float, 0, True, "a number >= 0")


def setting(text):
    """`KEY=VALUE` -> `(key, value)`, the value read as a Python literal where it is one."""
    key, separator, value = text.partition("=")
    if not separator or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


class Parts:
    """A comma-separated choice of some of `names` (`embeddings,encoder`) -> a list, each once."""

    def __init__(self, *names):
        self.names = names
        self.description = f"some of {', '.join(names)}, comma-separated"

    def accepts(self, value):
        return (
            isinstance(value, (list, tuple))
            and bool(value)
            and all(part in self.names for part in value)
            and len(set(value)) == len(value)
        )

    def __call__(self, text):
        value = [part.strip() for part in text.split(",")]
        if not self.accepts(value):
            raise argparse.ArgumentTypeError(f"expected {self.description}, got {text!r}")
        return value

    def __repr__(self):
        return f"Parts{self.names!r}"


def parts_of(*names):
    return Parts(*names)

"""The optional results of a layer call (`return_weights=`, `cache=`), as Keras MHA returns them.

A call returns its outputs alone, or a tuple of the outputs and, in a fixed
order, each optional result that was asked for.
"""


def with_optional(outputs, *optional):
    """`outputs` alone when every `optional` result is None, else `(outputs, *those not None)`."""
    extra = tuple(value for value in optional if value is not None)
    return (outputs, *extra) if extra else outputs


def split_optional(results, *asked):
    """The inverse of `with_optional`: `(outputs, *(result or None for each flag in asked))`."""
    if not any(asked):
        return (results, *(None for _ in asked))
    outputs, *rest = results
    rest = iter(rest)
    return (outputs, *(next(rest) if flag else None for flag in asked))

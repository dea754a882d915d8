"""Synthetic sequence tasks (copy, reverse) for checking that a model learns
and decodes, in seconds, without any corpus.

Shape legend: n = examples, max_length = longest sequence.
"""

import numpy as np

from keras_transformer.utils.checks import check_choice, check_positive_int

TASKS = ("copy", "reverse")


def sequence_task(
    task, num_examples, vocab_size, max_length=10, seed=0, pad_id=0, bos_id=2, eos_id=3, first_symbol=4
):
    """Random symbol sequences and their copy or reversal, as `fit` inputs.

    Sequences have 1..max_length symbols drawn from
    `[first_symbol, vocab_size)`; ids below `first_symbol` are special.

    Returns:
        `(inputs, labels)`: `inputs = {"source_ids": (n, max_length),
        "target_ids": (n, max_length + 1)}` (target right-shifted behind
        `bos_id`), `labels (n, max_length + 1)` ending in `eos_id`; int32,
        padded with `pad_id`.

    Example:
    >>> inputs, labels = sequence_task("reverse", 1, vocab_size=10, max_length=3, seed=1)
    >>> inputs["source_ids"].tolist(), inputs["target_ids"].tolist(), labels.tolist()
    ([[7, 8, 0]], [[2, 8, 7, 0]], [[8, 7, 3, 0]])
    """
    check_choice("task", task, TASKS)
    check_positive_int("num_examples", num_examples)
    check_positive_int("max_length", max_length)
    if vocab_size <= first_symbol:
        raise ValueError(f"vocab_size must be > first_symbol={first_symbol}; got {vocab_size}.")
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_length + 1, size=num_examples)
    source = np.full((num_examples, max_length), pad_id, np.int32)
    target_in = np.full((num_examples, max_length + 1), pad_id, np.int32)
    labels = np.full((num_examples, max_length + 1), pad_id, np.int32)
    for i, length in enumerate(lengths):
        symbols = rng.integers(first_symbol, vocab_size, size=length)
        output = symbols[::-1] if task == "reverse" else symbols
        source[i, :length] = symbols
        target_in[i, 0] = bos_id
        target_in[i, 1 : length + 1] = output
        labels[i, :length] = output
        labels[i, length] = eos_id
    return {"source_ids": source, "target_ids": target_in}, labels

"""The decoding policy is written once (`keras_transformer.decoding.policy`) and means the same in
NumPy (the ONNX Runtime driver) and in Keras (the graph search)."""

import ast
import os

import numpy as np
from keras import ops

from keras_transformer.decoding import policy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_length_penalty_is_gnmts():
    assert policy.length_penalty(1, 0.6) == 1.0  # ((5 + 1) / 6) ** alpha
    assert policy.length_penalty(7, 0.0) == 1.0  # alpha 0: log-probability alone
    np.testing.assert_allclose(policy.length_penalty(np.float32(13), 0.6), 3.0**0.6, rtol=1e-6)
    lengths = np.array([1, 10, 50], np.float32)
    assert policy.length_penalty(lengths, np.float32(0.6)).dtype == np.float32  # searches stay float32


def test_output_limits_clip_to_the_models_positions():
    lengths = np.array([0, 3, 200])
    np.testing.assert_array_equal(policy.output_limits(lengths, 128, np), [50, 53, 128])
    np.testing.assert_array_equal(policy.output_limits(lengths, 128, np, max_extra_length=0), [1, 3, 128])
    in_keras = ops.convert_to_numpy(policy.output_limits(lengths, 128, ops))
    np.testing.assert_array_equal(in_keras, [50, 53, 128])


def test_stopping_rule_is_the_same_in_numpy_and_keras():
    rng = np.random.default_rng(0)
    for step in (1, 5, 9):
        alive = rng.normal(-8, 3, (64, 4)).astype(np.float32)
        alive[rng.random((64, 4)) < 0.3] = policy.NEG_INF  # dead slots (their candidate ended)
        finished = np.sort(rng.normal(-6, 3, (64, 4)).astype(np.float32), axis=1)[:, ::-1].copy()
        limits = rng.integers(5, 12, 64).astype(np.float32)
        in_numpy = policy.search_is_final(step, limits, alive, finished, 0.6, np)
        in_keras = ops.convert_to_numpy(policy.search_is_final(step, limits, alive, finished, 0.6, ops))
        np.testing.assert_array_equal(in_numpy, in_keras)
        assert 0 < in_numpy.sum() < 64


def test_a_dead_slot_zero_does_not_end_the_search():
    # Slot 0's candidate ended in EOS this step; slot 1 is live and can still beat the pool.
    alive = np.array([[policy.NEG_INF, -1.0]], np.float32)
    finished = np.array([[-0.5, -3.0]], np.float32)
    assert not policy.search_is_final(2, np.array([20.0], np.float32), alive, finished, 0.6, np)[0]
    assert policy.search_is_final(20, np.array([20.0], np.float32), alive, finished, 0.6, np)[0]  # limit


def test_early_stopping_ends_a_sentence_once_its_pool_is_full():
    # Row 0: a full pool that the live hypothesis could still beat (-1.0 / penalty(20) > -3.0);
    # row 1: a pool with an empty slot; row 2: a full pool no live hypothesis can beat.
    alive = np.array([[-1.0, -2.0], [-1.0, -2.0], [-40.0, -50.0]], np.float32)
    empty = policy.NEG_INF / policy.length_penalty(np.float32(3), 0.6)
    finished = np.array([[-0.5, -3.0], [-0.5, empty], [-0.5, -3.0]], np.float32)
    limits = np.full((3,), 20.0, np.float32)
    exact = policy.search_is_final(3, limits, alive, finished, 0.6, np)
    early = policy.search_is_final(3, limits, alive, finished, 0.6, np, early_stopping=True)
    np.testing.assert_array_equal(exact, [False, False, True])
    np.testing.assert_array_equal(early, [True, False, True])
    for flag, want in ((True, early), (False, exact)):  # a request's option: a tensor in a graph
        tensor = ops.convert_to_tensor(flag)
        got = ops.convert_to_numpy(policy.search_is_final(3, limits, alive, finished, 0.6, ops, tensor))
        np.testing.assert_array_equal(got, want)


def test_the_onnx_runtime_driver_uses_the_same_module():
    from keras_transformer_export import onnx_runtime

    assert onnx_runtime.policy is policy


def _gnmt_formulas(path):
    """Lines of `path` computing `(5 + x) / 6` (either operand order of the sum)."""
    with open(path, encoding="utf-8") as source:
        tree = ast.parse(source.read(), path)

    def constant(node, value):
        return isinstance(node, ast.Constant) and node.value == value

    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.Div)
        and constant(node.right, 6)
        and isinstance(node.left, ast.BinOp)
        and isinstance(node.left.op, ast.Add)
        and (constant(node.left.left, 5) or constant(node.left.right, 5))
    ]


def test_the_length_penalty_is_written_once():
    """No other module computes GNMT's formula: the searches call `policy.length_penalty`."""
    found, where = [], os.path.join("decoding", "policy.py")
    for folder in ("keras_transformer", "export", "scripts"):
        for directory, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in files:
                path = os.path.join(directory, name)
                if name.endswith(".py"):
                    lines = _gnmt_formulas(path)
                    if path.endswith(where):
                        assert lines, "the policy module no longer has the formula this test looks for"
                    else:
                        found += [f"{path}:{line}" for line in lines]
    assert not found, found


def test_the_tokenizer_and_the_policy_agree_on_unk():
    """Two definitions the layering keeps apart (data may not import decoding)."""
    from keras_transformer.data.tokenizer import UNK_ID

    assert policy.UNK_ID == UNK_ID


def test_the_pieces_of_control_characters_are_never_output():
    """A translation holds no control character (a newline would split it across two lines of
    an output file; a NUL ends it in `translate_text.onnx`'s C-string detokenizer): the byte
    pieces of ASCII control bytes and pieces holding a Cc character are never output, with the
    special ids of `NEVER_OUTPUT` (and pieces of the Unicode line separators); the other byte
    pieces, <unk>, EOS and ordinary pieces are."""
    pieces = ["<pad>", "<unk>", "<s>", "</s>", "<0x00>", "<0x0A>", "<0x09>", "<0x1F>", "<0x20>", "<0x7F>"]
    pieces += ["<0x80>", "<0xC3>", "▁Hund", "a\tb", "x\x85", "▁", "<0x0a>x", "\u2028"]
    never = policy.never_output_ids(pieces.__getitem__, len(pieces), [0, 2], vocab_size=len(pieces) + 2)
    assert len(never) == len(pieces) + 2
    assert [pieces[i] for i in range(len(pieces)) if never[i]] == [
        "<pad>", "<s>", "<0x00>", "<0x0A>", "<0x09>", "<0x1F>", "<0x7F>", "a\tb", "x\x85", "\u2028"
    ]  # fmt: skip
    assert never[-2:] == [False, False]  # ids past the tokenizer's pieces: none of its pieces

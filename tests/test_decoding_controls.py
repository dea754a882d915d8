"""The decoding controls' rules (keras_transformer.decoding.controls, .sampling, .policy): the
same on NumPy and Keras, as CTranslate2 defines them (checked against direct definitions),
and what they do to a trained model's search (the synthetic reverse task)."""

import itertools

import numpy as np
import pytest
from keras import ops

import keras_transformer as kt
from keras_transformer.decoding import controls as rules
from keras_transformer.decoding import policy, sampling
from keras_transformer.decoding.controls import DecodingOptions
from keras_transformer.decoding.request import decode

VOCAB = 12


def _both(function, *args):
    """`function(*args, xp)` on NumPy and on Keras ops: the results, as NumPy arrays."""
    numpy_result = function(*args, np)
    keras_result = ops.convert_to_numpy(function(*(ops.convert_to_tensor(a) for a in args), ops))
    return np.asarray(numpy_result), keras_result


def _history(seed=0, sentences=3, beam=2, length=9):
    rng = np.random.default_rng(seed)
    return rng.integers(4, 8, size=(sentences, beam, length)).astype(np.int32)  # few ids: many repeats


@pytest.mark.parametrize("size", [0, 1, 2, 3])
@pytest.mark.parametrize("step", [0, 1, 4, 9])
def test_no_repeat_ngram_bans_exactly_the_tokens_that_would_repeat_an_ngram(size, step):
    history = _history()
    banned_numpy, banned_keras = _both(
        lambda h, xp: rules.banned_tokens(*rules.repeated_ngram_ends(h, step, size, xp), VOCAB, xp), history
    )
    np.testing.assert_array_equal(banned_numpy, banned_keras)
    for s, b in itertools.product(range(3), range(2)):
        tokens = history[s, b, :step].tolist()
        expected = set()  # CTranslate2's NoRepeatNgram, written out
        if size > 0 and step >= size - 1:
            tail = tokens[step - size + 1 :] if size > 1 else []
            for p in range(size - 1, step):
                if tokens[p - size + 1 : p] == tail:
                    expected.add(tokens[p])
        assert set(np.flatnonzero(banned_numpy[s, b])) == expected


def test_suppressed_sequences_ban_the_last_token_after_the_others():
    history = _history(seed=1)
    sequences = np.array([[5, 6, 0], [7, 0, 0], [4, 5, 6], [9, 9, 0]], np.int32)
    lengths = np.sum(sequences != 0, axis=1)
    for step in range(10):
        banned_numpy, banned_keras = _both(
            lambda h, xp, step=step: rules.banned_tokens(
                *rules.sequence_ends(h, step, sequences, lengths, xp), VOCAB, xp
            ),
            history,
        )
        np.testing.assert_array_equal(banned_numpy, banned_keras)
        for s, b in itertools.product(range(3), range(2)):
            tokens = history[s, b, :step].tolist()
            expected = {
                seq[n - 1]
                for seq, n in zip(sequences.tolist(), lengths)
                if n > 1 and step >= n - 1 and tokens[step - n + 1 :] == seq[: n - 1]
            }
            assert set(np.flatnonzero(banned_numpy[s, b])) == expected
    single = rules.single_token_bans(sequences, lengths, VOCAB, np)
    assert np.flatnonzero(single).tolist() == [7]


def test_repetition_penalty_is_ctranslate2s_on_the_logits():
    history = _history(seed=2)
    logits = np.random.default_rng(3).normal(size=(3, 2, VOCAB)).astype(np.float32)
    step = 5
    numpy_result, keras_result = _both(
        lambda lg, h, xp: rules.repetition_penalized(lg, h, step, np.float32(1.5), 0, xp), logits, history
    )
    np.testing.assert_array_equal(numpy_result, keras_result)
    for s, b in itertools.product(range(3), range(2)):
        seen = set(history[s, b, :step].tolist())
        for token in range(VOCAB):
            value = logits[s, b, token]
            expected = (value * 1.5 if value < 0 else value / 1.5) if token in seen else value
            assert numpy_result[s, b, token] == np.float32(expected)


def test_a_prefix_forces_its_tokens_over_every_ban_then_lets_go():
    raw = np.log(np.full((2, 2, VOCAB), 1.0 / VOCAB, np.float32))
    banned = np.where(np.arange(VOCAB) == 6, policy.NEG_INF, raw).astype(np.float32)
    prefix = np.array([[6, 5], [0, 0]], np.int32)
    lengths = np.array([2, 0], np.int32)
    for step in range(3):
        numpy_result, keras_result = _both(
            lambda lp, r, xp, step=step: rules.forced_prefix(lp, r, step, prefix, lengths, xp), banned, raw
        )
        np.testing.assert_array_equal(numpy_result, keras_result)
        if step < 2:  # sentence 0 forced (token 6 allowed although banned), sentence 1 free
            assert np.flatnonzero(numpy_result[0, 0] > policy.NEG_INF / 2).tolist() == [[6, 5][step]]
        else:
            np.testing.assert_array_equal(numpy_result[0], banned[0])
        np.testing.assert_array_equal(numpy_result[1], banned[1])


def test_the_output_rules_in_one_pass():
    log_probs = np.zeros((3, 1, VOCAB), np.float32)
    never = np.isin(np.arange(VOCAB), [0, 2, 9])
    is_eos = np.arange(VOCAB) == 3
    limits = np.array([5, 2, 9], np.int32)
    numpy_result, keras_result = _both(
        lambda lp, xp: policy.constrain(lp, 1, limits, never, is_eos, 4, xp), log_probs
    )
    np.testing.assert_array_equal(numpy_result, keras_result)
    allowed = numpy_result[:, 0] > policy.NEG_INF / 2
    assert np.flatnonzero(allowed[0]).tolist() == [1, 4, 5, 6, 7, 8, 10, 11]  # EOS too early
    assert np.flatnonzero(allowed[1]).tolist() == [3]  # the limit wins over min_length


def test_blank_pieces_and_empty_sources():
    assert all(policy.blank_piece(p) for p in ["\u2581", "\t", "<0x07>", "<0x20>", " \u200b"])
    assert not any(policy.blank_piece(p) for p in ["\u2581a", "<0xC3>", "<0x41>", "x"])
    pieces = ["<pad>", "<unk>", "<s>", "</s>", "\u2581", "\u2581a"]
    blank = np.array(policy.blank_ids(pieces.__getitem__, len(pieces)))
    assert blank.tolist() == [True, False, True, True, True, False]
    sources = np.array([[3, 0, 0], [4, 4, 3], [4, 5, 3], [1, 3, 0]], np.int32)
    numpy_result, keras_result = _both(lambda s, xp: policy.empty_sources(s, blank, xp), sources)
    assert numpy_result.tolist() == keras_result.tolist() == [True, True, False, False]


# ------------------------------------------------------------------------ sampling


def _chi_square(counts, probabilities):
    expected = probabilities * counts.sum()
    return float(np.sum((counts - expected) ** 2 / expected))


def test_the_counter_hash_is_uniform_and_independent_across_its_keys():
    """Uniform on [0, 1) in 100 bins, and no dependence between neighbouring tokens, sentences,
    samples, steps or seeds (20 x 20 bins of neighbouring pairs): chi-square per degree of
    freedom ~1 (a linear hash gives ~0.3 and ~20,000 here)."""
    rows = np.arange(2000)
    for keys in (
        sampling.row_keys(0, rows, 0, 3, np),  # sentences
        sampling.row_keys(0, 5, rows, 3, np),  # samples
        sampling.row_keys(0, 5, 0, rows, np),  # steps
        sampling.row_keys(rows, 5, 0, 3, np),  # seeds
    ):
        u = sampling.uniform(np.broadcast_to(keys, rows.shape), 300, np).astype(np.float64)
        counts = np.histogram(u, bins=100, range=(0, 1))[0]
        assert _chi_square(counts, np.full(100, 0.01)) / 99 < 1.6
        for a, b in ((u[:, :-1], u[:, 1:]), (u[:-1], u[1:])):
            pairs = np.histogram2d(a.ravel(), b.ravel(), bins=20, range=[[0, 1], [0, 1]])[0]
            assert _chi_square(pairs.ravel(), np.full(400, 1 / 400)) / 399 < 1.6


def test_the_top_of_the_hash_range_is_below_one_and_samples_by_probability():
    """The hash's largest value, `k = 2^24 - 1`, gave u = 1 in float32 and Gumbel noise +inf: with
    seed 7 the first step of sentence 19 (vocabulary 8000) sampled token 4387 whatever its
    probability, and NumPy warned of a log of zero (an error under `-W error`). Now u stays
    below 1 there, the same on NumPy and Keras, and the token is no longer forced."""
    vocab = 8000
    keys = sampling.row_keys(7, np.arange(32), 0, 0, np)
    u = sampling.uniform(keys, vocab, np)
    assert u[19, 4387] == np.float32(1 - 2**-24) == u.max() and np.all(u > 0)
    keras_u = ops.convert_to_numpy(sampling.uniform(ops.convert_to_tensor(keys), vocab, ops))
    np.testing.assert_array_equal(keras_u, u)
    log_probs = np.full((32, vocab), -30.0, np.float32)
    log_probs[:, 0] = 0.0  # token 0 has all but ~2e-10 of the probability in every row
    tokens = sampling.sample(log_probs, keys, 0, np.float32(1.0), np.float32(1.0), np)
    keras_tokens = sampling.sample(
        ops.convert_to_tensor(log_probs), ops.convert_to_tensor(keys), 0, 1.0, 1.0, ops
    )
    assert tokens.tolist() == ops.convert_to_numpy(keras_tokens).tolist() == [0] * 32


def test_seeds_that_differ_above_bit_31_sample_differently():
    """A seed is hashed in 31-bit parts: seeds equal modulo 2^31 once gave the same samples, and
    a seed near 2^63 overflowed an int64 sum (ONNX Runtime's graph then sampled otherwise than
    Keras). A seed below 2^31 keeps its keys. Also converted by tf2onnx, whose int64 `Greater`
    compares in float32 (2^31 + 5 and 2^31 - 1 are equal there): ONNX Runtime's keys equal."""
    seeds = [5, 2**31 + 5, 2**32 + 5, 2**62 + 5, 2**63 - 1]
    keys = np.stack([sampling.row_keys(seed, np.arange(4), 0, 2, np) for seed in seeds])
    assert len({tuple(row) for row in keys.tolist()}) == len(seeds)
    keras_keys = [
        ops.convert_to_numpy(sampling.row_keys(ops.convert_to_tensor(seed, "int64"), np.arange(4), 0, 2, ops))
        for seed in seeds
    ]
    np.testing.assert_array_equal(np.stack(keras_keys), keys)
    one_part = sampling._mix((5 + 0x2545F491) % 2**31)  # the seed's hash before the parts
    for part in (np.arange(4), 0, 2):
        one_part = sampling._mix((one_part + np.asarray(part, np.int64)) % 2**31)
    np.testing.assert_array_equal(keys[0], one_part)
    import onnxruntime
    import tensorflow as tf
    import tf2onnx

    spec = [tf.TensorSpec([], tf.int64, name="seed")]

    @tf.function(input_signature=spec)
    def keras_row_keys(seed):
        return sampling.row_keys(seed, tf.range(4, dtype=tf.int64), 0, 2, ops)

    converted, _ = tf2onnx.convert.from_function(keras_row_keys, input_signature=spec, opset=17)
    session = onnxruntime.InferenceSession(converted.SerializeToString(), providers=["CPUExecutionProvider"])
    onnx_keys = [session.run(None, {"seed": np.array(seed, np.int64)})[0] for seed in seeds]
    np.testing.assert_array_equal(np.stack(onnx_keys), keys)


@pytest.mark.parametrize(
    "topk, topp, temperature, support",
    [(0, 1.0, 1.0, 5), (2, 1.0, 1.0, 2), (0, 0.8, 1.0, 3), (0, 1.0, 0.5, 5), (3, 0.6, 2.0, 2)],
)
def test_sample_frequencies_match_the_restricted_softmax(topk, topp, temperature, support):
    """One step, 20,000 rows: the token frequencies against softmax(log_probs / T) over the
    top-k, then top-p set (chi-square below the 99.9% quantile), identical on NumPy and Keras."""
    p = np.array([0.45, 0.25, 0.15, 0.1, 0.05], np.float32)
    log_probs = np.concatenate([np.log(p), np.full(3, policy.NEG_INF, np.float32)])  # 3 banned
    rows = 20000
    table = np.tile(log_probs, (rows, 1))
    keys = sampling.row_keys(11, np.arange(rows), 0, 4, np)
    tokens = sampling.sample(table, keys, topk, np.float32(topp), np.float32(temperature), np)
    keras_tokens = ops.convert_to_numpy(
        sampling.sample(
            ops.convert_to_tensor(table), ops.convert_to_tensor(keys), topk, topp, temperature, ops
        )
    )
    assert np.mean(tokens == keras_tokens) > 0.999  # float32 log/exp may differ in the last bit
    tempered = p ** (1 / temperature)
    kept = tempered[:support] / tempered[:support].sum()
    counts = np.bincount(tokens, minlength=8)
    assert counts[support:].sum() == 0
    critical = {1: 10.8, 2: 13.8, 3: 16.3, 4: 18.5}[support - 1]  # chi-square 99.9% quantiles
    assert _chi_square(counts[:support].astype(float), kept) < critical


# -------------------------------------------------------------- the trained model


@pytest.fixture(scope="module")
def reverse_sources(reverse_model):
    inputs, _ = kt.sequence_task("reverse", 16, reverse_model.vocab, max_length=10, seed=7)
    return np.asarray(inputs["source_ids"])


def test_top_k_1_sampling_is_greedy_search(reverse_model, reverse_sources):
    model = reverse_model.model
    greedy = kt.greedy_search(model, reverse_sources)
    sampled = kt.sample(model, reverse_sources, sampling_topk=1, seed=5)
    np.testing.assert_array_equal(np.asarray(sampled.ids)[:, 0], np.asarray(greedy.ids))


@pytest.mark.parametrize("length", [1, 3, 6])
def test_forcing_greedy_prefix_returns_the_greedy_output(reverse_model, reverse_sources, length):
    model = reverse_model.model
    greedy = np.asarray(kt.greedy_search(model, reverse_sources).ids)
    prefix = [[int(t) for t in row[:length] if t not in (0, 3)] for row in greedy]
    forced = decode(
        model, reverse_sources, DecodingOptions(length_penalty=0.0), beam_size=1, target_prefix=prefix
    )
    np.testing.assert_array_equal(np.asarray(forced.ids)[:, 0], greedy)


def test_forcing_the_best_output_returns_it(reverse_model, reverse_sources):
    model = reverse_model.model
    best = np.asarray(decode(model, reverse_sources).ids)[:, 0]
    prefix = [[int(t) for t in row if t not in (0, 3)] for row in best]
    forced = decode(model, reverse_sources, target_prefix=prefix)
    np.testing.assert_array_equal(np.asarray(forced.ids)[:, 0], best)


def test_a_controls_ban_comes_before_the_softmax_as_in_ctranslate2(reverse_model, reverse_sources):
    """A banned token's probability goes to the others (CTranslate2's `DisableTokens` on the
    logits): greedy search's log-probability is the teacher-forced one of the logits without
    the banned token, and differs from the unrenormalized one."""
    model = reverse_model.model
    config = model.config
    banned = int(np.asarray(kt.greedy_search(model, reverse_sources).ids)[0, 0])  # a likely token
    found = decode(
        model,
        reverse_sources,
        DecodingOptions(length_penalty=0.0),
        beam_size=1,
        suppress_sequences=[[banned]],
    )
    labels = np.asarray(found.ids)[:, 0]  # (batch, len): EOS-terminated, padded
    assert not np.any(labels == banned)
    inputs = np.concatenate([np.full((len(labels), 1), config.bos_id), labels[:, :-1]], axis=1)
    logits = np.asarray(
        model({"source_ids": reverse_sources, "target_ids": inputs}, training=False), np.float64
    )
    real = labels != config.pad_id

    def teacher_forced(log_probs):
        picked = np.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
        return np.sum(np.where(real, picked, 0.0), axis=1)

    def log_softmax(values):
        shifted = values - values.max(axis=-1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))

    without = logits.copy()
    without[..., banned] = -np.inf
    np.testing.assert_allclose(
        np.asarray(found.log_probs)[:, 0], teacher_forced(log_softmax(without)), atol=1e-4
    )
    assert np.all(teacher_forced(log_softmax(logits)) < teacher_forced(log_softmax(without)) - 1e-3)


def test_alignments_of_the_reverse_task_run_backwards(reverse_model, reverse_sources):
    """Target token j of a reversed sequence of n symbols is source symbol n - 1 - j: the
    alignment has the shape of the output, -1 from EOS on, and is decreasing."""
    model = reverse_model.model
    found = decode(model, reverse_sources, DecodingOptions(return_alignments=True, num_return=2))
    ids, alignments = np.asarray(found.ids), np.asarray(found.alignments)
    assert alignments.shape == ids.shape
    exact = 0
    for source, hypothesis, alignment in zip(reverse_sources, ids[:, 0], alignments[:, 0]):
        n = int(np.sum(source != 0))  # symbols (this task has no source EOS)
        length = int(np.argmax(hypothesis == 3))
        assert np.all(alignment[length:] == -1) and np.all(alignment[:length] >= 0)
        assert np.all(np.diff(alignment[:length]) <= 0)  # monotone, backwards
        exact += int(alignment[:length].tolist() == list(range(n - 1, -1, -1)))
    assert exact >= 0.9 * len(reverse_sources)


def test_options_are_checked_with_one_line_naming_the_option():
    with pytest.raises(ValueError, match=r"^unknown decoding option\(s\) \['beam'\]"):
        DecodingOptions().replace(beam=3)
    with pytest.raises(ValueError, match="^length_penalty must be a number; got 'x'"):
        DecodingOptions(length_penalty="x").check()
    assert DecodingOptions(num_return=9, sampling_topk=0).check(4).sampling
    # An integer its graph dtype cannot hold (int64 seed, int32 others): one line, not an overflow.
    assert DecodingOptions(seed=2**63 - 1, max_extra_length=2**31 - 1).check()
    with pytest.raises(
        ValueError, match="^seed must be at most 9223372036854775807; got 9223372036854775808.$"
    ):
        DecodingOptions(seed=2**63).check()
    with pytest.raises(ValueError, match="^max_extra_length must be at most 2147483647; got 2147483648.$"):
        DecodingOptions(max_extra_length=2**31).check()

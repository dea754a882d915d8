import numpy as np
import pytest
import tensorflow as tf

import keras_transformer as kt
from keras_transformer.decoding import search as search_module
from keras_transformer.layers import multi_head_attention as mha_module


def _reversed_with_eos(source, eos_id=3):
    return [list(row[row != 0][::-1]) + [eos_id] for row in source]


def _strip(ids, eos_id=3):
    """Token lists up to and including EOS."""
    out = []
    for row in np.asarray(ids):
        row = list(row)
        out.append(row[: row.index(eos_id) + 1] if eos_id in row else row)
    return out


def _count_decoder_rows(model, monkeypatch):
    """A list that gets the rows of every decoding step of `model` from now on."""
    rows = []
    decode_step = type(model).decode_step

    def counting(self, token_ids, *args, **kwargs):
        rows.append(int(token_ids.shape[0]))
        return decode_step(self, token_ids, *args, **kwargs)

    monkeypatch.setattr(type(model), "decode_step", counting)
    return rows


def _unseen_sources(count=200, seed=7):
    inputs, _ = kt.sequence_task("reverse", count, 20, max_length=10, seed=seed)
    return inputs["source_ids"]


@pytest.mark.parametrize("mode", kt.ATTENTION_MODES)
@pytest.mark.parametrize("policy", ["fixed", "growing"])
def test_cached_step_logits_equal_a_full_forward_pass(mode, policy):
    model = kt.Transformer.from_preset("tiny", vocab_size=30, attention_mode=mode)
    rng = np.random.default_rng(0)
    source = rng.integers(4, 30, size=(3, 6)).astype("int32")
    source[1, 4:] = 0
    target = np.concatenate([np.full((3, 1), 2), rng.integers(4, 30, size=(3, 7))], axis=1)
    full = np.asarray(model({"source_ids": source, "target_ids": target}))  # (3, 8, vocab)
    memory = model.encode(source)
    cache = model.init_cache(memory, max_length=10 if policy == "fixed" else None)
    mask = kt.padding_mask(source)
    for step in range(target.shape[1]):
        logits, cache = model.decode_step(target[:, step], step if policy == "fixed" else None, cache, mask)
        np.testing.assert_allclose(logits, full[:, step], atol=1e-5, err_msg=f"step {step}")
        assert cache.self_key[0].shape[2] == (10 if policy == "fixed" else step + 1)


def test_cross_attention_keys_are_computed_once_per_sentence_for_every_beam():
    """Cross keys/values once per sentence, heads-first; the beams of a sentence (rows in a
    row) read them through the folded query axis and get what per-beam copies give."""
    model = kt.Transformer.from_preset("tiny", vocab_size=30)
    source = np.array([[5, 6, 7], [8, 9, 0]], "int32")
    cache = model.init_cache(model.encode(source), beam_size=3)
    assert cache.self_key[0].shape == (6, 4, 0, 16)
    assert cache.cross_key[0].shape == (2, 4, 3, 16)
    tokens = np.array([2, 2, 2, 2, 2, 2], "int32")
    logits, after = model.decode_step(tokens, None, cache, kt.padding_mask(source))
    assert after.self_key[0].shape == (6, 4, 1, 16)
    np.testing.assert_array_equal(after.cross_key[1], cache.cross_key[1])
    repeated = model.init_cache(model.encode(np.repeat(source, 3, axis=0)))
    expected, _ = model.decode_step(tokens, None, repeated, kt.padding_mask(np.repeat(source, 3, axis=0)))
    np.testing.assert_allclose(logits, expected, atol=1e-5)


def test_a_fixed_size_cache_fills_in_place():
    model = kt.Transformer.from_preset("tiny", vocab_size=30)
    source = np.array([[5, 6, 7]], "int32")
    cache = model.init_cache(model.encode(source), max_length=6)
    assert cache.self_key[0].shape == (1, 4, 6, 16)
    _, after = model.decode_step(np.array([2], "int32"), 0, cache, kt.padding_mask(source))
    written = np.abs(np.asarray(after.self_key[0])).sum(axis=(0, 1, 3))
    assert written[0] > 0 and np.all(written[1:] == 0)


def test_beam_of_one_without_penalty_is_greedy(reverse_model):
    sources = _unseen_sources(100)
    greedy = kt.greedy_search(reverse_model.model, sources)
    beam = kt.beam_search(reverse_model.model, sources, beam_size=1, length_penalty=0.0)
    np.testing.assert_array_equal(beam.ids, greedy.ids)
    np.testing.assert_allclose(beam.log_probs, greedy.log_probs, atol=1e-5)


def test_beam_of_one_is_greedy_on_an_untrained_model_too():
    model = kt.Transformer.from_preset("tiny", vocab_size=30)
    sources = np.random.default_rng(3).integers(4, 30, size=(16, 7)).astype("int32")
    sources[::2, 4:] = 0
    greedy = kt.greedy_search(model, sources, max_extra_length=6)
    beam = kt.beam_search(model, sources, beam_size=1, length_penalty=0.0, max_extra_length=6)
    np.testing.assert_array_equal(beam.ids, greedy.ids)


def test_beam_never_scores_below_greedy_without_length_penalty(reverse_model):
    sources = _unseen_sources(200, seed=11)
    greedy = kt.greedy_search(reverse_model.model, sources)
    beam = kt.beam_search(reverse_model.model, sources, beam_size=4, length_penalty=0.0)
    assert np.all(np.asarray(beam.log_probs) >= np.asarray(greedy.log_probs) - 1e-4)


def test_trained_model_decodes_unseen_sequences_exactly(reverse_model):
    sources = _unseen_sources(200, seed=13)
    expected = _reversed_with_eos(sources)
    for result in (
        kt.greedy_search(reverse_model.model, sources),
        kt.beam_search(reverse_model.model, sources),
    ):  # beam 4, alpha 0.6
        decoded = _strip(result.ids)
        exact = np.mean([d == e for d, e in zip(decoded, expected)])
        assert exact >= 0.98, exact


def test_n_best_is_sorted_distinct_and_scored(reverse_model):
    sources = _unseen_sources(20, seed=17)
    result = kt.beam_search(reverse_model.model, sources, beam_size=4, num_return=4)
    assert result.ids.shape[:2] == (20, 4)
    scores, log_probs = np.asarray(result.scores), np.asarray(result.log_probs)
    assert np.all(np.diff(scores, axis=1) <= 1e-6)  # best first
    lengths = np.array([[len(h) for h in _strip(row)] for row in np.asarray(result.ids)])
    np.testing.assert_allclose(scores, log_probs / ((5 + lengths) / 6) ** 0.6, rtol=1e-5)
    for row in np.asarray(result.ids):
        assert len({tuple(h) for h in row}) == 4


def test_early_stopping_ends_each_search_when_its_pool_fills(reverse_model, monkeypatch):
    """`early_stopping=True` (CTranslate2's stop rule) decodes fewer steps and returns the pool as it
    stood when it filled: the searches agree until then, so the exact search's pool is the best of
    a superset of the candidates and scores at least as well at every rank."""
    model = reverse_model.model
    sources = _unseen_sources(16, seed=43)
    rows = _count_decoder_rows(model, monkeypatch)
    found = {}
    for early in (False, True):
        rows.clear()
        found[early] = kt.beam_search(
            model, sources, beam_size=4, num_return=4, length_penalty=1.0, cache_policy="growing",
            early_stopping=early,
        )  # fmt: skip
        found[early, "rows"] = sum(rows)
    exact, early = found[False], found[True]
    assert found[True, "rows"] < found[False, "rows"]  # fewer decoder rows in all
    assert np.all(np.asarray(early.scores) <= np.asarray(exact.scores) + 1e-5)
    assert np.any(np.asarray(early.scores) < np.asarray(exact.scores) - 1e-3)  # some pool did change
    expected = _reversed_with_eos(sources)
    assert np.mean([d == e for d, e in zip(_strip(early.ids[:, 0]), expected)]) >= 0.9


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_batch_invariance(reverse_model, search):
    sources = _unseen_sources(6, seed=19)
    decode = (
        (lambda s: kt.greedy_search(reverse_model.model, s))
        if search == "greedy"
        else (lambda s: kt.beam_search(reverse_model.model, s, beam_size=4))
    )
    together = _strip(decode(sources).ids)
    for i, source in enumerate(sources):
        alone = source[None, : max(1, int((source != 0).sum()))]  # no padding at all
        assert _strip(decode(alone).ids)[0] == together[i]


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_xla_compiled_decoding_gives_the_eager_tokens(reverse_model, search, monkeypatch):
    """Under XLA the beam search halves its batch of 8 as sentences finish (8 -> 4 -> 2 -> 1)
    and finds its candidates blockwise (blocks of 4 columns here, so that this small vocabulary
    takes that path); the fixed cache is split after 4 positions (so that these short outputs
    cross into the tail): the eager tokens, whole pools included."""
    model = reverse_model.model
    sources = _unseen_sources(8, seed=23)
    monkeypatch.setattr(search_module, "FIXED_CACHE_BLOCK", 4)
    if search == "greedy":

        def decode(s):
            return kt.greedy_search(model, s)
    else:
        monkeypatch.setattr(search_module, "TOP_K_BLOCK", 4)

        def decode(s):
            return kt.beam_search(model, s, beam_size=4, num_return=4)

    eager = decode(sources)
    compiled = tf.function(decode, jit_compile=True)(tf.constant(sources))
    np.testing.assert_array_equal(compiled.ids, eager.ids)
    np.testing.assert_allclose(compiled.scores, eager.scores, atol=1e-4)


def test_blockwise_top_k_under_xla_is_top_k_ties_included():
    """`_top_candidates` (XLA's path) returns `top_k`'s values and indices, the lower index first
    among equal values: rows of few distinct values, all equal, all impossible, one -inf pad."""
    rng = np.random.default_rng(3)
    values = rng.integers(-5, 1, size=(5, 1003)).astype("float32")  # 1003: the last block padded
    values[1] = 0.0
    values[2] = -1.0e9
    values[3, ::7] = 2.0  # more maxima than k, in many blocks
    values[4] = np.sort(rng.normal(size=1003)).astype("float32")  # the best in the padded block
    for k in (1, 4):
        found = tf.function(lambda v, k=k: search_module._top_candidates(v, k, block=16), jit_compile=True)(
            values
        )
        expected = tf.math.top_k(values, k=k)
        np.testing.assert_array_equal(found[0], expected.values)
        np.testing.assert_array_equal(found[1], expected.indices)


@pytest.mark.parametrize("vocab", [1000, 1003])  # blocks of 125; blocks of 128, the last padded
def test_candidates_from_logits_are_the_candidates_top_k(vocab):
    """`_top_candidates_of_logits` (XLA's path without controls) finds `_top_candidates`' values
    and indices of `alive + constrain(log_softmax(logits))` exactly, under XLA as the search
    compiles them: ties across blocks and beams, dead beams, the last step (EOS alone),
    `min_length` (EOS banned), the best logit on a banned id, in the padded block."""
    from types import SimpleNamespace

    from keras_transformer.decoding import policy

    rng = np.random.default_rng(5)
    sentences, beam, pad, bos, eos = 6, 4, 0, 2, 3
    logits = rng.integers(-8, 4, size=(sentences, beam, vocab)).astype("float32")  # many ties
    logits[0] += rng.normal(size=(beam, vocab)).astype("float32")
    logits[1, :, bos] = 50.0  # the best logit banned
    logits[2, :, eos] = 50.0
    logits[3, :, -1] = 40.0  # in the last (padded) block
    alive = rng.normal(size=(sentences, beam)).astype("float32") - 3.0
    alive[:, 1:] = np.where(rng.random((sentences, beam - 1)) < 0.3, policy.NEG_INF, alive[:, 1:])
    alive[4] = 0.0  # equal beams: ties across beams
    limits = np.array([30, 30, 30, 30, 6, 30], "int32")  # sentence 4 at its last step
    ids = np.arange(vocab)
    setup = SimpleNamespace(
        config=SimpleNamespace(target_vocab=vocab, pad_id=pad, bos_id=bos, eos_id=eos),
        never=tf.constant((ids == pad) | (ids == bos)), never_ids=[pad, bos], is_eos=tf.constant(ids == eos),
        min_length=0,
    )  # fmt: skip
    for step, min_length in ((5, 0), (1, 4)):  # the last step of sentence 4; EOS banned (step < 3)
        setup.min_length = min_length

        def both(logits, alive, step=step, min_length=min_length):
            log_probs = policy.constrain(
                tf.nn.log_softmax(logits),
                step,
                limits,
                setup.never,
                setup.is_eos,
                min_length,
                tf.experimental.numpy,
            )
            candidates = tf.reshape(alive[:, :, None] + log_probs, (sentences, beam * vocab))
            reference = search_module._top_candidates(candidates, beam, block=16)
            found = search_module._top_candidates_of_logits(
                setup, tf.reshape(logits, (-1, vocab)), alive, step, limits, beam
            )
            return reference, found

        reference, found = tf.function(both, jit_compile=True)(tf.constant(logits), tf.constant(alive))
        np.testing.assert_array_equal(found[1], reference[1])
        np.testing.assert_array_equal(found[0], reference[0])
        top = np.asarray(found[1])
        assert np.all(top[4] % vocab == eos) if step == 5 else not np.any(top % vocab == eos)


@pytest.mark.parametrize("block", [32, 4])
@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_both_cache_policies_give_the_same_tokens_eagerly_and_in_a_graph(
    reverse_model, search, block, monkeypatch
):
    """The growing cache (sentences leaving the batch) and the fixed-size one (all stay), that
    one split after `block` positions (4: the outputs cross into the tail)."""
    monkeypatch.setattr(search_module, "FIXED_CACHE_BLOCK", block)
    model = reverse_model.model
    sources = _unseen_sources(12, seed=37)

    def decode(s, policy):
        if search == "greedy":
            return kt.greedy_search(model, s, cache_policy=policy)
        return kt.beam_search(model, s, beam_size=4, num_return=4, cache_policy=policy)

    fixed = decode(sources, "fixed")
    graph = tf.function(
        lambda s: decode(s, "growing"), input_signature=[tf.TensorSpec([None, None], tf.int32)]
    )
    for result in (decode(sources, "growing"), graph(tf.constant(sources))):
        np.testing.assert_array_equal(result.ids, fixed.ids)
        np.testing.assert_allclose(result.scores, fixed.scores, atol=1e-5)
        np.testing.assert_allclose(result.log_probs, fixed.log_probs, atol=1e-5)


def test_finished_sentences_leave_the_batch(reverse_model, monkeypatch):
    """With the growing cache a sentence whose search is final stops costing decoder rows;
    its result stays in input order. The fixed cache sheds them in halvings of the batch."""
    model = reverse_model.model
    sources = _unseen_sources(6, seed=41)
    sources[0, 2:] = 0  # a short sentence finishes early
    sources[0, 1] = 3
    rows = _count_decoder_rows(model, monkeypatch)
    growing = kt.beam_search(model, sources, beam_size=2, cache_policy="growing")
    steps_growing, rows_growing = len(rows), list(rows)
    rows.clear()
    fixed = kt.beam_search(model, sources, beam_size=2, cache_policy="fixed")
    np.testing.assert_array_equal(growing.ids, fixed.ids)
    # The fixed cache keeps static shapes: it halves its batch (6 -> 3 -> 2 -> 1 sentences) once
    # that many are left, never below the live ones, and takes as many steps.
    assert set(rows) <= {12, 6, 4, 2} and rows == sorted(rows, reverse=True) and rows[-1] < 12
    assert steps_growing == len(rows)
    assert all(fixed_rows >= growing_rows for fixed_rows, growing_rows in zip(rows, rows_growing))
    assert (
        rows_growing[0] == 12 and rows_growing[-1] < 12 and rows_growing == sorted(rows_growing, reverse=True)
    )


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_a_fixed_cache_steps_over_its_first_block_alone(reverse_model, search, monkeypatch):
    """The steps before position `FIXED_CACHE_BLOCK` read that many cache positions; the later
    ones all (source length + 50), with the same tokens as the growing cache. Greedy search
    splits its cache (the early steps get the first block alone); a beam search keeps the whole
    cache, never reordered, and reads it through each row's history."""
    monkeypatch.setattr(search_module, "FIXED_CACHE_BLOCK", 3)
    model = reverse_model.model
    sources = _unseen_sources(4, seed=47)
    max_len = min(sources.shape[1] + 50, model.config.max_length)  # the cache's positions
    steps, read = [], []
    decode_step = type(model).decode_step
    rows_by_position = mha_module.rows_by_position

    def recording(self, token_ids, step, cache, memory_mask, cache_history=None, **kwargs):
        size = int(cache.self_key[0].shape[2])
        steps.append((int(step), size))
        assert (cache_history is None) == (search == "greedy")
        # The tied embeddings, transposed once before the loop (a fixed cache: XLA, JAX).
        assert tuple(kwargs["projection_kernel"].shape) == (model.config.d_model, model.config.vocab_size)
        if cache_history is not None:  # every position's row, for each of this step's rows
            assert cache_history.block == 3 and size == max_len
            assert tuple(cache_history.rows.shape) == (token_ids.shape[0], max_len)
        return decode_step(self, token_ids, step, cache, memory_mask, cache_history, **kwargs)

    def reading(tensor, rows):  # the positions a step's attention reads (a beam search's)
        read.append((steps[-1][0], int(rows.shape[1])))
        return rows_by_position(tensor, rows)

    def decode(policy):
        if search == "greedy":
            return kt.greedy_search(model, sources, cache_policy=policy)
        return kt.beam_search(model, sources, beam_size=3, num_return=3, cache_policy=policy)

    growing = decode("growing")
    monkeypatch.setattr(type(model), "decode_step", recording)
    monkeypatch.setattr(mha_module, "rows_by_position", reading)
    fixed = decode("fixed")
    np.testing.assert_array_equal(fixed.ids, growing.ids)
    assert len(steps) > 3
    if search == "greedy":
        assert steps[:3] == [(0, 3), (1, 3), (2, 3)]
        assert all(size == max_len for _, size in steps[3:]), steps
        assert not read
    else:  # keys and values of each layer: 2 * num_layers reads a step
        per_step = 2 * model.config.num_decoder_layers
        assert len(read) == per_step * len(steps)
        assert all(length == (3 if step < 3 else max_len) for step, length in read), read


def test_a_growing_cache_under_xla_is_refused_with_advice(reverse_model):
    decode = tf.function(
        lambda s: kt.beam_search(reverse_model.model, s, cache_policy="growing").ids, jit_compile=True
    )
    with pytest.raises(ValueError, match='use cache_policy="fixed"'):
        decode(tf.constant(_unseen_sources(2, seed=43)))


def test_uncached_decoding_gives_the_cached_tokens(reverse_model):
    sources = _unseen_sources(8, seed=29)
    for use_cache in (True, False):
        result = kt.beam_search(reverse_model.model, sources, beam_size=3, use_cache=use_cache)
        if use_cache:
            cached = result
    np.testing.assert_array_equal(result.ids, cached.ids)


def test_per_head_mode_decodes_the_same_tokens(reverse_model):
    model = reverse_model.model
    sources = _unseen_sources(8, seed=31)
    batched = kt.beam_search(model, sources)
    model.set_attention_mode("per_head")
    try:
        per_head = kt.beam_search(model, sources)
    finally:
        model.set_attention_mode("batched")
    np.testing.assert_array_equal(per_head.ids, batched.ids)


def test_outputs_end_with_eos_within_the_length_limit():
    model = kt.Transformer.from_preset("tiny", vocab_size=30)  # untrained: rarely says EOS
    sources = np.array([[5, 6, 7, 0, 0], [5, 6, 7, 8, 9]], "int32")
    for result in (
        kt.greedy_search(model, sources, max_extra_length=3),
        kt.beam_search(model, sources, beam_size=3, max_extra_length=3),
    ):
        lengths = [len(h) for h in _strip(result.ids)]
        assert all(h[-1] == 3 for h in _strip(result.ids))
        assert lengths[0] <= 3 + 3 and lengths[1] <= 5 + 3
        assert result.ids.shape[-1] == 5 + 3


def test_pad_and_bos_are_never_generated_even_when_the_model_prefers_them():
    """An output bias of +50 on pad and BOS: without the rule, greedy and beam emit them, and a
    generated pad makes cached decoding (no target padding mask) differ from uncached."""
    model = kt.Transformer.from_preset("tiny", vocab_size=30, tie_output=False)
    model.build()
    bias = np.asarray(model.output_projection.bias).copy()
    bias[[model.config.pad_id, model.config.bos_id]] = 50.0
    model.output_projection.bias.assign(bias)
    sources = np.array([[5, 6, 7, 3, 0], [5, 6, 7, 8, 3]], "int32")
    for search in (
        lambda **kw: kt.greedy_search(model, sources, max_extra_length=4, **kw),
        lambda **kw: kt.beam_search(model, sources, beam_size=3, max_extra_length=4, **kw),
    ):
        cached, uncached = search(), search(use_cache=False)
        np.testing.assert_array_equal(cached.ids, uncached.ids)
        np.testing.assert_allclose(cached.scores, uncached.scores, atol=1e-4)
        for hypothesis in _strip(cached.ids):
            assert hypothesis[-1] == 3 and not {0, 2} & set(hypothesis), hypothesis
        assert np.all(np.isfinite(cached.scores))


def test_empty_batch_gives_empty_results():
    model = kt.Transformer.from_preset("tiny", vocab_size=30)
    empty = np.zeros((0, 5), "int32")
    for result in (kt.greedy_search(model, empty), kt.beam_search(model, empty)):
        assert result.ids.shape[0] == 0 and result.scores.shape == (0,)


def test_all_padding_source_gives_a_defined_result():
    model = kt.Transformer.from_preset("tiny", vocab_size=30)
    sources = np.zeros((2, 4), "int32")
    for result in (
        kt.greedy_search(model, sources, max_extra_length=0),
        kt.beam_search(model, sources, max_extra_length=0),
    ):
        np.testing.assert_array_equal(np.asarray(result.ids)[:, 0], [3, 3])  # just EOS
        assert np.all(np.isfinite(result.scores))
    result = kt.beam_search(model, sources, max_extra_length=4)
    assert all(len(h) <= 4 and h[-1] == 3 for h in _strip(result.ids))


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(beam_size=0), "beam_size must be a positive integer"),
        (dict(beam_size=2, num_return=3), "num_return=3 must be <= beam_size=2"),
        (dict(max_extra_length=-1), "max_extra_length must be an integer >= 0"),
        (dict(length_penalty=-0.5), "length_penalty must be a number >= 0"),
        (dict(cache_policy="dynamic"), "cache_policy must be one of"),
    ],
)
def test_bad_search_arguments_raise_value_error(arguments, message):
    model = kt.Transformer.from_preset("tiny", vocab_size=30)
    with pytest.raises(ValueError) as error:
        kt.beam_search(model, np.array([[5, 6]], "int32"), **arguments)
    assert message in str(error.value)


def test_source_of_wrong_rank_is_reported():
    model = kt.Transformer.from_preset("tiny", vocab_size=30)
    with pytest.raises(ValueError, match=r"source_ids must have shape \(batch, length\)"):
        kt.greedy_search(model, np.array([5, 6], "int32"))
    with pytest.raises(ValueError, match="max_extra_length"):
        kt.greedy_search(model, np.array([[5, 6]], "int32"), max_extra_length=-2)


def test_min_length_suppresses_early_eos(reverse_model):
    sources = _unseen_sources(6, seed=37)
    for result in (
        kt.greedy_search(reverse_model.model, sources, min_length=12, max_length=12),
        kt.beam_search(reverse_model.model, sources, min_length=12, max_length=12),
    ):
        assert all(len(h) == 12 and h[-1] == 3 for h in _strip(result.ids))
    with pytest.raises(ValueError, match="min_length must be an integer >= 0"):
        kt.greedy_search(reverse_model.model, sources, min_length=-1)


def test_decoding_cache_is_named_reorders_and_flattens():
    from keras_transformer.layers.decoding_cache import DecodingCache

    model = kt.Transformer.from_preset("tiny", vocab_size=40)
    source = np.array([[5, 6, 7, 3], [8, 9, 3, 0]], "int32")
    cache = model.init_cache(model.encode(source), max_length=5)
    assert isinstance(cache, DecodingCache) and cache.num_layers == model.config.num_layers
    layer = cache.layer(1)
    assert layer.cross_key is cache.cross_key[1] and layer.self_value is cache.self_value[1]
    _, cache = model.decode_step(np.array([2, 2], "int32"), 0, cache, kt.padding_mask(source))
    swapped = cache.reorder(np.array([1, 0]))
    np.testing.assert_array_equal(swapped.self_key[0][0], cache.self_key[0][1])
    np.testing.assert_array_equal(swapped.cross_key[0], cache.cross_key[0])  # per sentence: unchanged
    assert swapped.cross_key[0].shape[0] == 2
    second = cache.select_sentences(np.array([1]))
    np.testing.assert_array_equal(second.cross_value[1][0], cache.cross_value[1][1])
    assert second.self_key[0].shape[0] == 2  # the rows leave through reorder
    assert DecodingCache.from_flat(cache.flat(), cache.num_layers) == cache
    with pytest.raises(ValueError, match="is 8 tensors; got 3"):
        DecodingCache.from_flat(cache.flat()[:3], 2)

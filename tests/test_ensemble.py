"""An `Ensemble` decodes as one model whose next-token distribution is its members' mean."""

import numpy as np
import pytest

import keras_transformer as kt
from keras_transformer.decoding import policy
from keras_transformer.utils.checks import UserError


def _members():
    """Two tiny models of different depths and weights (one vocabulary)."""
    first = kt.Transformer.from_preset("tiny", vocab_size=30, num_layers=1)
    second = kt.Transformer.from_preset("tiny", vocab_size=30, num_layers=2, d_ff=48)
    return first, second


def _sources():
    source = np.random.default_rng(3).integers(4, 30, size=(3, 6)).astype("int32")
    source[1, 4:] = 0
    return source


def _mean_log_probs(logits):
    probs = [np.exp(x - x.max(-1, keepdims=True)) for x in map(np.asarray, logits)]
    probs = [p / p.sum(-1, keepdims=True) for p in probs]
    return np.log(np.mean(probs, axis=0))


@pytest.mark.parametrize("members", [2, 3])
def test_the_mean_is_logsumexp_over_the_members_without_its_stack_and_guards(members):
    """`Ensemble._mean` is `ops.logsumexp` of the stacked log-softmaxes (minus log n), bit for bit,
    and stays finite where the members disagree by thousands of nats."""
    from keras import ops

    rng = np.random.default_rng(members)
    for scale in (1.0, 30.0, 3000.0):
        logits = [(rng.normal(size=(16, 500)) * scale).astype("float32") for _ in range(members)]
        stacked = ops.stack([ops.log_softmax(x, axis=-1) for x in logits])
        expected = np.asarray(ops.logsumexp(stacked, axis=0) - np.log(members).astype("float32"))
        found = np.asarray(kt.Ensemble._mean(logits))
        assert np.isfinite(found).all()
        np.testing.assert_array_equal(found, expected, err_msg=f"scale {scale}")


@pytest.mark.parametrize("policy", ["fixed", "growing"])
def test_each_step_is_the_log_of_the_members_mean_probability(policy):
    members = _members()
    ensemble = kt.Ensemble(members)
    source = _sources()
    target = np.concatenate([np.full((3, 1), 2), np.random.default_rng(4).integers(4, 30, (3, 6))], axis=1)
    inputs = {"source_ids": source, "target_ids": target}
    expected = _mean_log_probs([m(inputs) for m in members])  # (3, 7, vocab), teacher forced
    np.testing.assert_allclose(ensemble(inputs), expected, atol=1e-5)
    cache = ensemble.init_cache(ensemble.encode(source), max_length=8 if policy == "fixed" else None)
    assert len(cache.self_key) == 3  # member 0's layer, then member 1's two
    mask = kt.padding_mask(source)
    for step in range(target.shape[1]):
        position = step if policy == "fixed" else None
        logits, cache = ensemble.decode_step(target[:, step], position, cache, mask)
        np.testing.assert_allclose(logits, expected[:, step], atol=1e-5, err_msg=f"step {step}")


def test_greedy_search_picks_the_most_probable_token_of_the_mean():
    members = _members()
    ensemble = kt.Ensemble(members)
    source = _sources()
    found = kt.greedy_search(ensemble, source, max_length=7)  # 6 tokens, then EOS at the latest
    never = [getattr(ensemble.config, name) for name in policy.NEVER_OUTPUT]
    prefix = np.full((3, 1), 2, "int32")  # a greedy search done by hand: full passes, no cache
    for _ in range(6):
        logits = _mean_log_probs([m({"source_ids": source, "target_ids": prefix}) for m in members])[:, -1]
        logits[:, never] = -np.inf
        prefix = np.concatenate([prefix, logits.argmax(-1)[:, None].astype("int32")], axis=1)
    for row, ids in zip(prefix[:, 1:], np.asarray(found.ids)):
        end = list(row).index(3) + 1 if 3 in row else len(row)  # up to EOS
        np.testing.assert_array_equal(ids[:end], row[:end])


@pytest.mark.parametrize("cache", ["growing", "fixed", "none"])
def test_beam_search_gives_the_same_tokens_with_every_cache(cache):
    ensemble = kt.Ensemble(_members())
    source = _sources()
    reference = kt.beam_search(ensemble, source, beam_size=3, max_extra_length=6, num_return=3)
    found = kt.beam_search(
        ensemble,
        source,
        beam_size=3,
        max_extra_length=6,
        num_return=3,
        use_cache=cache != "none",
        cache_policy="auto" if cache == "none" else cache,
    )
    np.testing.assert_array_equal(found.ids, reference.ids)
    np.testing.assert_allclose(found.scores, reference.scores, atol=1e-4)


def test_a_model_ensembled_with_itself_decodes_as_the_model_alone():
    model = _members()[1]
    source = _sources()
    alone = kt.beam_search(model, source, beam_size=4, max_extra_length=6)
    twice = kt.beam_search(kt.Ensemble([model, model]), source, beam_size=4, max_extra_length=6)
    np.testing.assert_array_equal(twice.ids, alone.ids)
    np.testing.assert_allclose(twice.scores, alone.scores, atol=1e-4)
    aligned = kt.align(kt.Ensemble([model, model]), source, np.asarray(alone.ids)[:, None])
    np.testing.assert_array_equal(aligned, kt.align(model, source, np.asarray(alone.ids)[:, None]))
    # The controls act on the mean's log-probabilities as on one model's.
    controls = dict(
        target_prefix=[[5, 6], [], [7]], suppress_sequences=[[8], [9, 10]], no_repeat_ngram_size=2
    )
    for search, options in (
        (kt.beam_search, dict(beam_size=3, num_return=2, **controls)),
        (kt.sample, dict(num_return=2, sampling_topk=5, sampling_temperature=0.7, seed=11, **controls)),
    ):
        alone = search(model, source, max_extra_length=6, **options)
        twice = search(kt.Ensemble([model, model]), source, max_extra_length=6, **options)
        np.testing.assert_array_equal(twice.ids, alone.ids, err_msg=search.__name__)


def test_members_that_cannot_be_one_ensemble_are_refused_in_one_line():
    first = kt.Transformer.from_preset("tiny", vocab_size=30)
    refusal = r"model 1 has vocab_size 31 and model 0 30: an ensemble's members share"
    with pytest.raises(UserError, match=refusal):
        kt.Ensemble([first, kt.Transformer.from_preset("tiny", vocab_size=31)])
    with pytest.raises(UserError, match="model 1 has d_model 32 and model 0 64"):
        kt.Ensemble([first, kt.Transformer.from_preset("tiny", vocab_size=30, d_model=32)])
    with pytest.raises(UserError, match="runs/b has vocab_size 31 and runs/a 30"):  # the CLI names paths
        kt.Ensemble([first, kt.Transformer.from_preset("tiny", vocab_size=31)], names=["runs/a", "runs/b"])
    with pytest.raises(UserError, match="two or more models; got 1"):
        kt.Ensemble([first])


def test_the_command_line_translates_with_an_ensemble_and_refuses_two_vocabularies(
    document_run, synthetic_files, tmp_path, monkeypatch, capsys
):
    import io
    import shutil
    import sys

    from keras_transformer import cli

    lines = ["the dog sees the cat", "a bird eats"]

    def translate(*models):
        stdin = io.TextIOWrapper(io.BytesIO(("\n".join(lines) + "\n").encode("utf-8")))
        monkeypatch.setattr(sys, "stdin", stdin)
        arguments = ["translate", "--model", *map(str, models), "--beam-size", "2", "--scores"]
        assert cli.main(arguments + ["--alignments"]) == 0
        return capsys.readouterr().out.splitlines()

    assert translate(document_run, document_run) == translate(document_run)  # the mean of one model
    translator = kt.load_translator([document_run, document_run / "model.keras"], beam_size=2)
    assert isinstance(translator.model, kt.Ensemble) and len(translator.model) == 2
    other = tmp_path / "other"
    shutil.copytree(document_run, other)
    texts = synthetic_files[0].read_text(encoding="utf-8").splitlines()
    kt.Tokenizer.train(texts, 280).save(other / "tokenizer.model")
    assert cli.main(["translate", "--model", str(document_run), str(other)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "have different vocabularies" in error and "--tokenizer" in error


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_under_xla_an_ensemble_decodes_its_eager_tokens(search, monkeypatch):
    """XLA takes the fixed cache and each member's own projection kernel; a block of 4 positions
    makes the outputs cross it (the greedy split cache, the beams' histories)."""
    import tensorflow as tf

    from keras_transformer.decoding import search as search_module

    monkeypatch.setattr(search_module, "FIXED_CACHE_BLOCK", 4)
    ensemble = kt.Ensemble(_members())

    def decode(source):
        if search == "greedy":
            return kt.greedy_search(ensemble, source, max_extra_length=6)
        return kt.beam_search(ensemble, source, beam_size=3, num_return=3, max_extra_length=6)

    eager = decode(_sources())
    compiled = tf.function(decode, jit_compile=True)(tf.constant(_sources()))
    np.testing.assert_array_equal(compiled.ids, eager.ids)
    np.testing.assert_allclose(compiled.scores, eager.scores, atol=1e-4)

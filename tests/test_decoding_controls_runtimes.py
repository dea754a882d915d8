"""Every decoding control gives the same hypotheses in every runtime (issue 40).

On the 3-epoch `trained_run` model, for each request of `CASES` (a control, or
several): Keras (`Translator`: a `tf.function` whose inputs are the options, or
for the default request one with the options as Python values; with the growing
and the fixed-size cache; and `decode` run eagerly with Python options), the SavedModel's
`translate_with_options` through TF Serving's session path, ONNX Runtime's
`translate.onnx`, the NumPy driver of `encoder.onnx` + `decoder_step.onnx`,
`translate_lean.onnx` (the requests without controls; the others by `translate.onnx`) and
`translate_text.onnx` (in a process without TensorFlow)
give the same texts, the same alignments and the same scores (within 1e-4).
Bad requests get one line from Python and the command line and an
`InvalidArgument` from the graphs.
"""

import io
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from keras_transformer import cli
from keras_transformer.decoding import policy
from keras_transformer.decoding.controls import DecodingOptions, sentence_hypotheses

SENTENCE_COUNT = 6

# name -> translate_hypotheses arguments (the prefix ones are filled in from the default output).
CASES = {
    "default": {},
    "n_best": dict(num_return=3),
    "lengths": dict(min_length=9, max_extra_length=12, length_penalty=1.2),
    "prefix": dict(target_prefix="from the default translations"),
    "suppress": dict(suppress_sequences="from the default translations", disable_unk=True),
    "no_repeat_ngram": dict(no_repeat_ngram_size=2, num_return=2),
    "repetition_penalty": dict(repetition_penalty=1.6),
    # near-uniform samples from the whole vocabulary: byte pieces, some of control characters
    # (never output) and some not (invalid UTF-8 for the detokenizers to agree on); a seed past
    # 31 bits (2^31 + 7: tf2onnx once compared it as a float32)
    "sampling": dict(
        sampling_topk=0, sampling_temperature=30.0, num_return=3, seed=2**31 + 7, max_extra_length=12
    ),
    "sampling_topk_topp": dict(sampling_topk=5, sampling_topp=0.8, sampling_temperature=0.7, seed=3),
    "alignments": dict(return_alignments=True, num_return=2),
    # CTranslate2's stop rule: the search of a sentence ends once its pool is full (this model runs
    # most beams to the length limit, so here the rule seldom stops one earlier: what it changes is
    # pinned on the reversal model, tests/test_decoding.py; this case pins its plumbing per runtime)
    "early_stopping": dict(early_stopping=True, num_return=4, length_penalty=1.0),
}


@pytest.fixture(scope="module")
def parts(trained_run):
    from keras_transformer.training.run_directory import RunDirectory, load_model

    return load_model(trained_run / "model.keras"), RunDirectory(trained_run).tokenizer()


@pytest.fixture(scope="module")
def sentences(synthetic_files):
    lines = synthetic_files[0].read_text(encoding="utf-8").splitlines()
    # the shortest ones (this model runs most beams to the length limit), and two without content
    return sorted(lines, key=len)[:SENTENCE_COUNT] + ["", " \t\x07 "]


@pytest.fixture(scope="module")
def translator(parts):
    from keras_transformer.decoding.translator import Translator

    return Translator(*parts)


@pytest.fixture(scope="module")
def requests(translator, sentences):
    """name -> (sentences, arguments): the prefixes are the first two words of the default
    translation (every other sentence); the banned sequences the most frequent word and
    bigram of the default translations."""
    texts = translator.translate(sentences)[0]
    words = [text.split() for text in texts]
    counts = {}
    for line in words:
        for gram in [(w,) for w in line] + list(zip(line, line[1:])):
            counts[gram] = counts.get(gram, 0) + 1
    frequent = [max((g for g in counts if len(g) == n), key=counts.get) for n in (1, 2)]
    filled = {}
    for name, arguments in CASES.items():
        arguments = dict(arguments)
        if "target_prefix" in arguments:
            arguments["target_prefix"] = [
                " ".join(w[:2]) if i % 2 == 0 else None for i, w in enumerate(words)
            ]
        if "suppress_sequences" in arguments:
            arguments["suppress_sequences"] = [" ".join(gram) for gram in frequent]
        filled[name] = (sentences, arguments)
    return filled


def _as_lists(hypotheses):
    return [
        [[h.text, h.score, h.alignment and [list(p) for p in h.alignment]] for h in s] for s in hypotheses
    ]


@pytest.fixture(scope="module")
def results(parts, translator, requests, exported):
    """runtime -> case -> per sentence `[text, score, alignment pairs]` of each hypothesis."""
    from keras_transformer.decoding.translator import Translator
    from keras_transformer_export.onnx_runtime import OnnxTranslator
    from keras_transformer_export.parity import hypotheses_in_subprocess
    from keras_transformer_export.tf_serving import ServingSession

    onnx_dir = str(exported[1])
    fixed = Translator(*parts, cache_policy="fixed")
    runtimes = {
        "keras": translator,
        "keras_fixed_cache": fixed,
        "onnx_full": OnnxTranslator(onnx_dir, "full"),
        "onnx_split": OnnxTranslator(onnx_dir, "split"),
        "onnx_lean": OnnxTranslator(onnx_dir, "lean"),
    }
    found = {
        name: {case: _as_lists(runtime.translate_hypotheses(s, **a)) for case, (s, a) in requests.items()}
        for name, runtime in runtimes.items()
    }
    found["keras_eager"] = {case: _eager(parts, s, a) for case, (s, a) in requests.items()}
    session = ServingSession(exported[0] / "tiny" / "1")
    found["saved_model"] = {case: _saved_model(session, s, a) for case, (s, a) in requests.items()}
    session.close()
    texts = hypotheses_in_subprocess(onnx_dir, list(requests.values()))
    found["onnx_text"] = {
        case: [[[h[0], h[1], h[3]] for h in s] for s in result] for case, result in zip(requests, texts)
    }
    return found


def _eager(parts, sentences, arguments):
    """`decode` run eagerly, with Python options, on all the sentences in one batch."""
    from keras_transformer.decoding.alignments import word_alignment
    from keras_transformer.decoding.request import decode
    from keras_transformer.decoding.search import token_array

    model, tokenizer = parts
    arguments = dict(arguments)
    prefix = arguments.pop("target_prefix", None)
    sequences = arguments.pop("suppress_sequences", [])
    options = DecodingOptions(**arguments)
    ids = tokenizer.encode(
        tf.constant(sentences), max_length=model.config.max_length, pad_to_max_length=False
    )

    def tokens(texts):
        return token_array(tokenizer.tokenize(tf.constant(texts)).to_list(), 0)

    found = decode(
        model,
        ids,
        options,
        target_prefix=None if prefix is None else tokens([p or "" for p in prefix]),
        suppress_sequences=tokens(sequences) if sequences else None,
        blank=np.array(policy.blank_ids(tokenizer.processor.id_to_piece, tokenizer.vocab_size)),
        never=_never(model, tokenizer),
    )
    rows = []
    for i, sentence in enumerate(sentences):
        hypotheses = np.asarray(found.ids[i])
        texts = [t.decode() for t in tokenizer.decode(hypotheses).numpy()]
        alignments = None
        if options.return_alignments:
            source = tokenizer.processor.encode(sentence, out_type=str)
            piece = tokenizer.processor.id_to_piece
            alignments = [
                word_alignment(source, [piece(int(t)) for t in h], a)
                for h, a in zip(hypotheses, np.asarray(found.alignments[i]))
            ]
        kept = sentence_hypotheses(
            texts, np.asarray(found.scores[i]), np.asarray(found.log_probs[i]), alignments
        )
        rows.append([[h.text, h.score, h.alignment and [list(p) for p in h.alignment]] for h in kept])
    return rows


def _never(model, tokenizer):
    specials = [getattr(model.config, name) for name in policy.NEVER_OUTPUT]
    return np.array(policy.never_output_ids(tokenizer.processor.id_to_piece, tokenizer.vocab_size, specials))


def _saved_model(session, sentences, arguments):
    """`translate_with_options` through TF Serving's session path."""
    from keras_transformer.decoding.translator import option_tensors

    arguments = dict(arguments)
    prefix = arguments.pop("target_prefix", None)
    sequences = arguments.pop("suppress_sequences", [])
    options = DecodingOptions(**arguments)
    outputs = session.run(
        "translate_with_options",
        text=np.array(sentences, object),
        target_prefix=np.array([p or "" for p in prefix] if prefix else [], object),
        suppress_sequences=np.array(sequences, object),
        **{name: value.numpy() for name, value in option_tensors(options).items()},
    )
    rows = []
    for i in range(len(sentences)):
        texts = [t.decode() for t in outputs["translations"][i]]
        alignments = None
        if options.return_alignments:
            alignments = [
                [tuple(map(int, pair.split("-"))) for pair in a.decode().split()]
                for a in outputs["alignments"][i]
            ]
        kept = sentence_hypotheses(texts, outputs["scores"][i], outputs["log_probs"][i], alignments)
        rows.append([[h.text, h.score, h.alignment and [list(p) for p in h.alignment]] for h in kept])
    return rows


RUNTIMES = (
    "keras_fixed_cache", "keras_eager", "saved_model", "onnx_full", "onnx_split", "onnx_lean", "onnx_text",
)  # fmt: skip


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("case", list(CASES))
def test_every_runtime_gives_keras_hypotheses(case, runtime, results):
    ours, theirs = results["keras"][case], results[runtime][case]
    assert [[h[0] for h in s] for s in theirs] == [[h[0] for h in s] for s in ours]
    assert [[h[2] for h in s] for s in theirs] == [[h[2] for h in s] for s in ours]
    np.testing.assert_allclose(
        [h[1] for s in theirs for h in s], [h[1] for s in ours for h in s], atol=1e-4, rtol=1e-5
    )


def test_the_controls_do_what_they_say(results, requests):
    keras = results["keras"]
    sentences = requests["default"][0]
    assert all(len(s) == 3 for s in keras["n_best"][:SENTENCE_COUNT])  # n-best: 3 distinct, sorted
    for s in keras["n_best"][:SENTENCE_COUNT]:
        assert len({h[0] for h in s}) == 3 and [h[1] for h in s] == sorted((h[1] for h in s), reverse=True)
    assert keras["n_best"][0][0] == keras["default"][0][0]
    # Empty sentences: empty translations with score 0, in every case and runtime.
    for runtime in results.values():
        for case in runtime.values():
            assert all(h[0] == "" and h[1] == 0.0 for s in case[SENTENCE_COUNT:] for h in s)
    prefixes = requests["prefix"][1]["target_prefix"]
    for prefix, hypotheses in zip(prefixes, keras["prefix"]):
        if prefix:
            assert hypotheses[0][0].startswith(prefix)
    banned_word, banned_bigram = requests["suppress"][1]["suppress_sequences"]
    for s in keras["suppress"]:
        words = s[0][0].split()
        assert banned_word not in words and banned_bigram not in s[0][0]
    for s in keras["no_repeat_ngram"]:
        for h in s:
            pieces = h[0].split()
            assert len(set(zip(pieces, pieces[1:]))) == len(pieces) - 1 if len(pieces) > 1 else True
    assert [s[0][0] for s in keras["sampling"]] != [s[0][0] for s in keras["default"]]
    assert len(sentences) == len(keras["alignments"])
    for s in keras["alignments"][:SENTENCE_COUNT]:
        assert all(h[2] and all(0 <= j < len(h[0].split()) for _, j in h[2]) for h in s)


def test_no_runtime_outputs_a_control_character(results, requests, parts):
    """The pieces of control characters are never output (`policy.never_output_ids`): before,
    the `sampling` case's translations held newlines, tabs and NULs (where `translate_text.onnx`
    cut the translation short). No text holds an ASCII control character (a C1 control spelled
    by two byte pieces may: not a piece). The model alone, without the rule, samples such
    pieces for this request: the case tests something."""
    from keras_transformer.decoding.search import sample

    for runtime, cases in results.items():
        for case, found in cases.items():
            texts = [h[0] for s in found for h in s]
            assert not [t for t in texts if any(ord(c) < 0x20 or ord(c) == 0x7F for c in t)], (runtime, case)
    model, tokenizer = parts
    sentences, arguments = requests["sampling"]
    ids = tokenizer.encode(tf.constant(sentences[:SENTENCE_COUNT]), max_length=64, pad_to_max_length=False)
    options = {k: v for k, v in arguments.items() if k != "num_return"}
    kwargs = dict(sampling_topk=0, sampling_temperature=options["sampling_temperature"], seed=options["seed"])
    kwargs.update(num_return=2, max_extra_length=options["max_extra_length"])
    never = _never(model, tokenizer)
    unruled = np.asarray(sample(model, ids, **kwargs).ids)
    assert np.any(never[unruled] & (unruled > 3)), "the model alone samples no control piece here"
    ruled = np.asarray(sample(model, ids, never=never, **kwargs).ids)
    assert not np.any(never[ruled] & (ruled > 3))  # 0: the padding after EOS


def test_sampling_does_not_depend_on_batching_and_changes_with_the_seed(translator, requests, monkeypatch):
    sentences, arguments = requests["sampling"]
    together = translator.translate_hypotheses(sentences, **arguments)  # one batch
    monkeypatch.setattr(translator, "batch_size", 1)
    alone = translator.translate_hypotheses(sentences, **arguments)
    assert [[h.text for h in s] for s in alone] == [[h.text for h in s] for s in together]
    np.testing.assert_allclose(
        [h.score for s in alone for h in s], [h.score for s in together for h in s], atol=1e-4
    )
    other_seed = translator.translate_hypotheses(sentences, **{**arguments, "seed": 8})
    texts = [[h.text for h in s] for s in other_seed[:SENTENCE_COUNT]]
    assert texts != [[h.text for h in s] for s in alone[:SENTENCE_COUNT]]


def test_a_request_traces_the_search_it_needs_once(parts, sentences):
    """A request with the translator's options runs a graph of its own (the options Python
    values), any other one the graph whose inputs are the options: a new seed is a new input,
    not a new graph; with XLA (options as Python values, one program each) the same request
    is not compiled again."""
    from keras_transformer.decoding.translator import Translator

    def traces(translator):
        functions = [translator._search] + ([] if translator._jit_compile else [translator._own_search])
        return sum(f.experimental_get_tracing_count() for f in functions)

    translator = Translator(*parts)
    for _ in range(2):
        translator.translate(sentences[:2])
    assert traces(translator) == 1
    for seed in (1, 2, 3):
        translator.translate(sentences[:2], sampling_topk=0, seed=seed)
    assert traces(translator) == 2
    compiled = Translator(*parts, jit_compile=True)
    first = [compiled.translate(sentences[:2])[0] for _ in range(2)]
    assert traces(compiled) == 1 and first[0] == first[1] == translator.translate(sentences[:2])[0]


def test_an_option_given_as_another_python_number_is_fed_as_its_graph_dtype(exported, translator):
    """`length_penalty=1` (an int for a float option) and a 34-bit seed reach every graph in the
    option's own dtype (`controls.OPTION_DTYPES`): ONNX Runtime once got int32 for the float."""
    from keras_transformer_export.onnx_runtime import OnnxTranslator

    sentences = ["the dog sees the cat"]
    for mode in ("full", "lean"):
        runtime = OnnxTranslator(str(exported[1]), mode)
        for arguments in (dict(length_penalty=1), dict(length_penalty=1, sampling_topk=0, seed=2**33)):
            found = runtime.translate_hypotheses(sentences, **arguments)
            expected = translator.translate_hypotheses(sentences, **{**arguments, "length_penalty": 1.0})
            assert [h.text for h in found[0]] == [h.text for h in expected[0]], (mode, arguments)


BAD = [
    (dict(num_return=5), "num_return must be in [1, beam size 4]"),
    (dict(num_return=0), "num_return must be in [1, beam size 4]"),
    (dict(sampling_topp=0.0), "sampling_topp must be a number in (0, 1]"),
    (dict(sampling_topp=1.5), "sampling_topp must be a number in (0, 1]"),
    (dict(sampling_temperature=0.0), "sampling_temperature must be a number > 0"),
    (dict(sampling_topk=-1), "sampling_topk must be an integer >= 0"),
    (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size must be an integer >= 0"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be a number > 0"),
    (
        dict(max_extra_length=0, target_prefix=["a b c d e f g h i j k l m n o"]),
        "target_prefix of sentence 0",
    ),
]


@pytest.mark.parametrize("arguments, message", BAD)
def test_bad_requests_get_one_line_in_python_and_invalid_argument_from_the_graphs(
    arguments, message, translator, exported
):
    from keras_transformer_export.onnx_runtime import OnnxTranslator

    for runtime in (translator, OnnxTranslator(str(exported[1]), "full")):
        with pytest.raises(ValueError) as error:
            runtime.translate_hypotheses(["the dog sees the cat"], **arguments)
        assert str(error.value).startswith(message) and "\n" not in str(error.value)


def _onnx_errors():
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    return state.Fail, state.InvalidArgument


ONNX_ERRORS = _onnx_errors()


def test_graphs_refuse_bad_options_with_invalid_argument(exported, translator):
    """Past the Python checks, each graph refuses by itself: the SavedModel with the check's
    message (`InvalidArgument`), ONNX Runtime with an error that names the check."""
    from keras_transformer.decoding.translator import option_tensors
    from keras_transformer_export.onnx_runtime import make_session
    from keras_transformer_export.tf_serving import ServingSession

    session = ServingSession(exported[0] / "tiny" / "1")
    onnx = make_session(os.path.join(exported[1], "translate.onnx"))
    source_ids = translator.encode(["the dog sees the cat"]).numpy()
    for name, value, words in [
        ("num_return", 9, "num_return must be in"),
        ("sampling_topp", 0.0, "sampling_topp must be"),
        ("sampling_temperature", -1.0, "sampling_temperature must be"),
        ("repetition_penalty", 0.0, "repetition_penalty must be"),
        ("no_repeat_ngram_size", -2, "no_repeat_ngram_size must be"),
        ("sampling_topk", -3, "sampling_topk must be"),
    ]:
        options = option_tensors(DecodingOptions())
        options[name] = tf.constant(value, options[name].dtype)
        feed = {k: v.numpy() for k, v in options.items()}
        empty = np.array([], object)
        with pytest.raises(tf.errors.InvalidArgumentError, match=words):
            session.run(
                "translate_with_options",
                text=np.array(["a"], object),
                target_prefix=empty,
                suppress_sequences=empty,
                **feed,
            )
        with pytest.raises(ONNX_ERRORS) as error:
            onnx.run(None, {"source_ids": source_ids, name: np.asarray(feed[name])})
        assert words.replace(" ", "_") in str(error.value)
    for prefix in (
        np.array([[2, 5]], np.int32),
        np.array([[4000, 5]], np.int32),
        np.full((1, 300), 7, np.int32),
    ):
        with pytest.raises(ONNX_ERRORS):
            onnx.run(None, {"source_ids": source_ids, "target_prefix": prefix})
    session.close()


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--n-best", "9"], "--n-best: num_return must be in [1, beam size 4]"),
        (["--sampling-topp", "0"], "sampling_topp must be a number in (0, 1]"),
        (
            ["--prefix-file", "/nonexistent/prefixes.txt"],
            "--prefix-file /nonexistent/prefixes.txt: cannot read it",
        ),
    ],
)
def test_translate_command_refuses_bad_options_in_one_line(
    arguments, message, trained_run, monkeypatch, capsys
):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"the dog\n")))
    assert cli.main(["translate", "--model", str(trained_run), *arguments]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith(f"keras-transformer: error: {message}")


def test_translate_command_prints_n_best_prefixes_and_alignments(trained_run, monkeypatch, capsys, tmp_path):
    lines = ["the dog sees the cat", "", "a bird eats"]
    (tmp_path / "prefix.txt").write_text("der\n\n\n", encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("\n".join(lines).encode() + b"\n")))
    arguments = [
        "--n-best",
        "2",
        "--alignments",
        "--prefix-file",
        str(tmp_path / "prefix.txt"),
        "--seed",
        "1",
    ]
    assert cli.main(["translate", "--model", str(trained_run), *arguments]) == 0
    output = [line.split(" ||| ") for line in capsys.readouterr().out.splitlines()]
    assert [fields[0] for fields in output] == ["0", "0", "1", "1", "2", "2"]
    assert all(len(fields) == 4 for fields in output)
    assert output[0][1].startswith("der") and output[2][1:3] == ["", "0.0000"]
    assert all(pair.count("-") == 1 for fields in output for pair in fields[3].split())
    (tmp_path / "short.txt").write_text("der\n", encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("\n".join(lines).encode() + b"\n")))
    assert (
        cli.main(["translate", "--model", str(trained_run), "--prefix-file", str(tmp_path / "short.txt")])
        == 2
    )
    assert "--prefix-file has 1 lines and the input 3" in capsys.readouterr().err

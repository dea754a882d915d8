"""Export: the SavedModel (TF Serving) and the ONNX graphs translate exactly
like `keras-transformer translate`; bad input never breaks `serving_default`;
a killed export leaves no visible version."""

import dataclasses
import hashlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from keras_transformer import cli
from keras_transformer.decoding.controls import DecodingOptions
from keras_transformer.utils.checks import UserError
from keras_transformer_export.layout import check_model_name, remove_abandoned, versions, write_models_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every runtime must reproduce the translations of these sentences token for token. They have 19
# to 93 source pieces, and this 3-epoch model runs every beam to the length limit, so the suite's
# decoding time grows with their number (40 take about 40% of the time that 100 took).
SENTENCES = 40


def _env():
    return {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"}


@pytest.fixture(scope="module")
def sentences(synthetic_files):
    lines = synthetic_files[0].read_text(encoding="utf-8").splitlines()
    return lines[-SENTENCES:]


@pytest.fixture(scope="module")
def cli_translations(trained_run, sentences):
    """What `keras-transformer translate` prints for the sentences."""
    completed = subprocess.run(
        [sys.executable, "-m", "keras_transformer.cli", "translate", "--model", str(trained_run)],
        input="\n".join(sentences) + "\n",
        capture_output=True,
        text=True,
        env=_env(),
        check=True,
    )
    translations = completed.stdout.split("\n")[:-1]
    assert len(translations) == len(sentences)
    return translations


@pytest.fixture(scope="module")
def serving_default(exported):
    return tf.saved_model.load(str(exported[0] / "tiny" / "1")).signatures["serving_default"]


def test_saved_model_layout_and_models_config(exported):
    serving, _ = exported
    assert versions(serving / "tiny") == [1]
    version = serving / "tiny" / "1"
    assert (version / "saved_model.pb").is_file() and (version / "variables").is_dir()
    assert (version / "assets.extra" / "tokenizer.model").is_file()
    metadata = json.loads((version / "assets.extra" / "export.json").read_text())
    assert metadata["decoding"] == {"beam_size": 4, **dataclasses.asdict(DecodingOptions())}
    config = (serving / "models.config").read_text()
    assert 'name: "tiny"' in config and 'base_path: "/models/tiny"' in config
    assert not [e for e in os.listdir(serving / "tiny") if e.startswith(".")]


FRESH_PROCESS = """
import json, sys
import tensorflow as tf
import tensorflow_text  # noqa: F401  (registers the SentencePiece ops, as TF Serving links them)
request = json.load(sys.stdin)
sentences = request["sentences"]
loaded = tf.saved_model.load(sys.argv[1]).signatures
outputs = loaded["serving_default"](text=tf.constant(sentences))
result = {
    "translations": [t.decode("utf-8") for t in outputs["translation"].numpy()],
    "scores": outputs["score"].numpy().tolist(),
    "target_ids": loaded["translate_ids"](source_ids=tf.constant(request["source_ids"]))[
        "target_ids"].numpy().tolist(),
    "log_likelihood": loaded["score"](source=tf.constant(sentences), target=tf.constant(
        request["targets"]))["log_likelihood"].numpy().tolist(),
}

# TF Serving's way: a SavedModelBundle in a TF1 session, Session::Run on the signature's
# tensor names, XLA off (TF Serving enables it only with a flag).
tf.config.optimizer.set_jit(False)
config = tf.compat.v1.ConfigProto()
config.graph_options.optimizer_options.global_jit_level = tf.compat.v1.OptimizerOptions.OFF
with tf.compat.v1.Session(graph=tf.Graph(), config=config) as session:
    meta_graph = tf.compat.v1.saved_model.loader.load(session, ["serve"], sys.argv[1])

    def run(name, **inputs):
        signature = meta_graph.signature_def[name]
        names = sorted(signature.outputs)
        values = session.run([signature.outputs[key].name for key in names],
                             feed_dict={signature.inputs[key].name: value for key, value in inputs.items()})
        return dict(zip(names, values))

    outputs = run("serving_default", text=sentences)
    result["session"] = {
        "translations": [t.decode("utf-8") for t in outputs["translation"]],
        "scores": outputs["score"].tolist(),
        "target_ids": run("translate_ids", source_ids=request["source_ids"])["target_ids"].tolist(),
        "log_likelihood": run("score", source=sentences, target=request["targets"])[
            "log_likelihood"].tolist(),
    }
result["project_modules"] = sorted(
    m for m in sys.modules if m.split(".")[0] in ("keras_transformer", "keras_transformer_export"))
print(json.dumps(result))
"""


def test_fresh_process_and_tf_serving_session_match_translate_cli(
    exported, trained_run, sentences, cli_translations, synthetic_files
):
    """`tf.saved_model.load` and TF Serving's loading path (TF1 session, tensor names, no XLA),
    in a process with only TensorFlow and tf-text: the translations of `keras-transformer
    translate`, and the same ids, scores and log-likelihoods from both paths."""
    from keras_transformer.training.run_directory import RunDirectory

    tokenizer = RunDirectory(trained_run).tokenizer()
    targets = synthetic_files[1].read_text(encoding="utf-8").splitlines()[-SENTENCES:]
    request = {
        "sentences": sentences,
        "targets": targets,
        "source_ids": tokenizer.encode(tf.constant(sentences[:16])).numpy().tolist(),
    }
    completed = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS, str(exported[0] / "tiny" / "1")],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        cwd="/",
        env={k: v for k, v in _env().items() if k != "PYTHONPATH"},
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(completed.stdout)
    assert result["project_modules"] == []
    assert result["translations"] == cli_translations
    assert np.all(np.isfinite(result["scores"]))
    session = result["session"]
    assert session["translations"] == cli_translations
    assert session["target_ids"] == result["target_ids"]
    np.testing.assert_allclose(session["scores"], result["scores"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(session["log_likelihood"], result["log_likelihood"], rtol=1e-5, atol=1e-5)


TF_TEXT_OPS = os.path.join(ROOT, "export", "tf_text_ops_2.20.0.json")


def _reachable_functions(meta_graph, signatures):
    """Names of the library functions that the `signatures` of a MetaGraphDef can call."""
    library = {f.signature.name: f for f in meta_graph.graph_def.library.function}
    nodes = {node.name: node for node in meta_graph.graph_def.node}

    def called(node_defs):
        for node in node_defs:
            for value in node.attr.values():
                for function in [value.func, *value.list.func]:
                    if function.name:
                        yield function.name
            if node.op in library:
                yield node.op

    pending = []
    for name in signatures:  # a signature's outputs are the top-level call nodes' tensors
        for tensor in meta_graph.signature_def[name].outputs.values():
            pending.extend(called([nodes[tensor.name.split(":")[0]]]))
    reached = set()
    while pending:
        name = pending.pop()
        if name not in reached and name in library:
            reached.add(name)
            pending.extend(called(library[name].node_def))
    return reached


PLAIN_SIGNATURES = ("serving_default", "translate_ids", "score", "translate_with_options")


def test_serving_graph_has_no_xla_and_only_ops_tf_serving_2_20_has(exported):
    """Static check of saved_model.pb: no function or node that the plain signatures can reach
    is marked for XLA (TF Serving runs without XLA unless a flag enables it, and a `jit_compile`
    function then fails on its first call; only `translate_xla` reaches one), and every op that
    is not TensorFlow's own is a tf-text 2.20.0 op whose definition there has all the attributes
    the node sets (else: "NodeDef mentions attr ... not in Op")."""
    from tensorflow.core.protobuf import saved_model_pb2

    saved_model = saved_model_pb2.SavedModel()
    saved_model.ParseFromString((exported[0] / "tiny" / "1" / "saved_model.pb").read_bytes())
    (meta_graph,) = saved_model.meta_graphs
    functions = meta_graph.graph_def.library.function
    nodes = list(meta_graph.graph_def.node) + [node for f in functions for node in f.node_def]
    function_names = {f.signature.name for f in functions}
    xla_attrs = ("_XlaMustCompile", "_XlaCompile", "_XlaScope", "_noinline_xla")

    def marked(names):
        chosen = [f for f in functions if f.signature.name in names]
        found = [f.signature.name for f in chosen if f.attr["_XlaMustCompile"].b]
        return found + [
            node.name
            for node in (node for f in chosen for node in f.node_def)
            if any(node.attr[a].b for a in xla_attrs if a in node.attr) or node.op.startswith(("Xla", "_Xla"))
        ]

    plain = _reachable_functions(meta_graph, PLAIN_SIGNATURES)
    assert plain and marked(plain) == []
    assert set(meta_graph.signature_def) == {*PLAIN_SIGNATURES, "translate_xla", "__saved_model_init_op"}
    assert marked(_reachable_functions(meta_graph, ["translate_xla"])), "translate_xla compiles nothing"
    inventory = json.loads(pathlib.Path(TF_TEXT_OPS).read_text(encoding="utf-8"))
    assert inventory["tensorflow_text"] == "2.20.0"
    foreign = {}
    for node in nodes:
        if node.op not in function_names and not hasattr(tf.raw_ops, node.op):
            foreign.setdefault(node.op, set()).update(a for a in node.attr if not a.startswith("_"))
    assert foreign, "the serving graph has no tf-text op: is the tokenizer still in the graph?"
    for op, attrs in foreign.items():
        assert op in inventory["ops"], f"{op} is not a tf-text 2.20.0 op"
        assert attrs <= set(inventory["ops"][op]["spelled"]), (op, attrs)


def test_saved_model_cli_shows_the_three_signatures(exported):
    tool = os.path.join(os.path.dirname(sys.executable), "saved_model_cli")
    shown = subprocess.run(
        [tool, "show", "--all", "--dir", str(exported[0] / "tiny" / "1")],
        capture_output=True,
        text=True,
        env=_env(),
        check=True,
    ).stdout

    def signature(name):
        match = re.search(rf"signature_def\['{name}'\]:(.*?)Method name is", shown, re.S)
        assert match, f"no signature {name} in:\n{shown}"
        return {
            key: (dtype, shape)
            for key, dtype, shape in re.findall(
                r"(?:inputs|outputs)\['(\w+)'\] tensor_info:\s+dtype: (\w+)\s+shape: (\([^)]*\))",
                match.group(1),
            )
        }

    assert signature("serving_default") == {
        "text": ("DT_STRING", "(-1)"),
        "translation": ("DT_STRING", "(-1)"),
        "score": ("DT_FLOAT", "(-1)"),
    }
    assert signature("translate_ids") == {
        "source_ids": ("DT_INT32", "(-1, -1)"),
        "target_ids": ("DT_INT32", "(-1, -1)"),
        "scores": ("DT_FLOAT", "(-1)"),
    }
    assert signature("score") == {
        "source": ("DT_STRING", "(-1)"),
        "target": ("DT_STRING", "(-1)"),
        "log_likelihood": ("DT_FLOAT", "(-1)"),
    }


def _check_outputs(serving_default, texts):
    outputs = serving_default(text=tf.constant(texts, tf.string))
    translations, scores = outputs["translation"].numpy(), outputs["score"].numpy()
    assert translations.shape == scores.shape == (len(texts),)
    assert np.all(np.isfinite(scores)) and np.all(scores <= 0)
    for text in translations:
        text.decode("utf-8")  # valid UTF-8
    return [t.decode("utf-8") for t in translations], scores


def test_serving_default_survives_bad_input(serving_default):
    bad = [
        b"",
        b"     ",
        b" \t\n\r ",
        ("word " * 2000).encode(),
        b"\xff\xfe caf\xc3 \x80",
        b"nul\x00 and \x07\x1b[31m",
        "\U0001f600\U0001f680 \u65e5\u672c\u8a9e \u0627\u0644\u0639\u0631\u0628\u064a\u0629 "
        "\u0928\u092e\u0938\u094d\u0924\u0947".encode(),
        "a\u0301\u200b\ufeff".encode(),
    ]
    translations, _ = _check_outputs(serving_default, bad)
    assert translations[0] == translations[1]  # spaces only: the empty sentence (NFKC + strip)
    empty = serving_default(text=tf.constant([], tf.string))
    assert empty["translation"].shape == (0,) and empty["score"].shape == (0,)
    rng = np.random.default_rng(0)
    words = ["the", "dog", "sees", "a", "cat", "\u00e9t\u00e9", "\U0001f600"]
    batch = [" ".join(rng.choice(words, size=rng.integers(0, 12))) for _ in range(160)]
    _check_outputs(serving_default, batch)  # a batch of mixed lengths, larger than any other here


def test_long_source_is_truncated_to_max_length(serving_default, trained_run):
    from keras_transformer.training.run_directory import RunDirectory

    tokenizer = RunDirectory(trained_run).tokenizer()
    max_length = RunDirectory(trained_run).settings()["model"]["max_length"]
    # A long text whose first max_length - 1 pieces end at a word boundary, so that
    # their detokenized prefix tokenizes back to the same pieces (else the two
    # sources would differ in their last piece).
    for lead in range(20):
        long = "a " * lead + "the dog sees the cat " * 2000
        ids = tokenizer.tokenize(tf.constant([long]))[0].numpy()
        if tokenizer.processor.id_to_piece(int(ids[max_length - 1])).startswith("\u2581"):
            break
    pieces = ids[: max_length - 1]
    prefix = tokenizer.detokenize(tf.constant(pieces[None])).numpy()[0]
    assert list(tokenizer.tokenize(tf.constant([prefix]))[0].numpy()) == list(pieces)
    translations, scores = _check_outputs(serving_default, [long.encode(), prefix])
    assert translations[0] == translations[1] and scores[0] == pytest.approx(scores[1], abs=1e-4)


def test_random_unicode_never_raises_or_changes_batch_size(serving_default):
    rng = np.random.default_rng(1)
    ranges = [(0x0, 0x7F), (0x80, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFD), (0x10000, 0x10FFFF)]
    strings = []
    for _ in range(128):
        chars = []
        for _ in range(rng.integers(0, 16)):
            low, high = ranges[rng.integers(len(ranges))]
            chars.append(chr(rng.integers(low, high + 1)))
        strings.append("".join(chars).encode("utf-8", errors="surrogatepass"))
    for start in range(0, len(strings), 64):
        _check_outputs(serving_default, strings[start : start + 64])


def test_score_signature_is_the_models_log_likelihood(exported, trained_run, synthetic_files):
    import keras

    from keras_transformer.data.tokenizer import BOS_ID, PAD_ID
    from keras_transformer.training.run_directory import RunDirectory, load_model

    sources = synthetic_files[0].read_text(encoding="utf-8").splitlines()[:8] + ["", "x"]
    targets = synthetic_files[1].read_text(encoding="utf-8").splitlines()[:8] + ["", ""]
    score = tf.saved_model.load(str(exported[0] / "tiny" / "1")).signatures["score"]
    log_likelihood = score(source=tf.constant(sources), target=tf.constant(targets))["log_likelihood"]

    model, tokenizer = load_model(trained_run / "model.keras"), RunDirectory(trained_run).tokenizer()
    source_ids = tokenizer.encode(tf.constant(sources)).numpy()
    labels = tokenizer.encode(tf.constant(targets)).numpy()
    inputs = np.concatenate([np.full((len(targets), 1), BOS_ID), labels[:, :-1]], axis=1)
    inputs = np.where(inputs == 3, PAD_ID, inputs)  # EOS never enters the decoder
    log_probs = keras.ops.log_softmax(model({"source_ids": source_ids, "target_ids": inputs}), axis=-1)
    picked = np.take_along_axis(np.asarray(log_probs), labels[..., None], axis=-1)[..., 0]
    expected = np.sum(np.where(labels != PAD_ID, picked, 0.0), axis=1)
    np.testing.assert_allclose(log_likelihood.numpy(), expected, rtol=1e-4, atol=1e-4)


def test_onnx_graphs_are_valid_with_dynamic_axes(exported):
    import onnx

    onnx_dir = exported[1]
    for stem in ("forward", "translate", "encoder", "decoder_step", "translate_text", "translate_lean"):
        model = onnx.load(str(onnx_dir / f"{stem}.onnx"))
        onnx.checker.check_model(model, full_check=True)
        assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) >= 17
        first_input = model.graph.input[0].type.tensor_type.shape.dim
        assert first_input[0].dim_param == "batch", stem
        if stem != "decoder_step":
            assert all(d.dim_param for d in first_input), stem  # batch and length are dynamic
    assert (onnx_dir / "tokenizer.model").is_file()
    metadata = json.loads((onnx_dir / "export.json").read_text())
    assert set(metadata["graphs"]) == {
        "forward",
        "translate",
        "encoder",
        "decoder_step",
        "align",
        "translate_text",
        "translate_lean",
    }


def test_onnx_runtime_matches_keras(exported, trained_run, sentences, cli_translations):
    from keras_transformer.decoding.translator import Translator
    from keras_transformer.training.run_directory import RunDirectory, load_model
    from keras_transformer_export.cache_names import cross_names, past_names, present_names
    from keras_transformer_export.onnx_runtime import (
        FullGraphSearch,
        OnnxTranslator,
        SplitBeamSearch,
        make_session,
    )
    from keras_transformer_export.parity import max_logit_difference

    onnx_dir = str(exported[1])
    model, tokenizer = load_model(trained_run / "model.keras"), RunDirectory(trained_run).tokenizer()
    # 1. forward.onnx: logits within 1e-4, teacher-forced on the CLI's translations.
    assert max_logit_difference(model, tokenizer, onnx_dir, sentences, cli_translations) < 1e-4

    # 2, 3. translate.onnx and encoder + decoder_step: the same tokens as Keras's beam search.
    translator = Translator(model, tokenizer)
    source_ids = translator.encode(sentences).numpy()
    found = translator.search_ids(source_ids)
    keras_ids, keras_scores = found.ids.numpy()[:, 0], found.scores.numpy()[:, 0]
    for search in (FullGraphSearch(onnx_dir), SplitBeamSearch(onnx_dir)):
        ids, scores = search(source_ids)
        np.testing.assert_array_equal(ids, keras_ids)
        np.testing.assert_allclose(scores, keras_scores, atol=1e-4)
    # Text in/out through sentencepiece (not tf-text) tokenization: the same strings as the CLI.
    assert OnnxTranslator(onnx_dir, "full").translate(sentences)[0] == cli_translations

    # decoder_step.onnx against Keras's decode_step for two steps: per-sentence cross caches
    # read by 2 beams each, a growing past (0 positions, then 1).
    encoded = make_session(os.path.join(onnx_dir, "encoder.onnx"))
    names = [o.name for o in encoded.get_outputs()]
    encoded = dict(zip(names, encoded.run(None, {"source_ids": source_ids[:4]})))
    layers, config = len(model.decoder.stack_layers), model.config
    shape = (8, config.num_heads, 0, config.d_model // config.num_heads)
    feed = {
        "token_ids": np.full(8, config.bos_id, np.int32),
        "memory_mask": encoded["memory_mask"],
        **{name: np.zeros(shape, np.float32) for name in past_names(layers)},
        **{name: encoded[name] for name in cross_names(layers)},
    }
    step = make_session(os.path.join(onnx_dir, "decoder_step.onnx"))
    from keras_transformer.layers.masks import padding_mask

    cache = model.init_cache(model.encode(source_ids[:4]), beam_size=2)
    for token in (config.bos_id, 7):
        feed["token_ids"] = np.full(8, token, np.int32)
        outputs = dict(zip([o.name for o in step.get_outputs()], step.run(None, feed)))
        keras_logits, cache = model.decode_step(
            feed["token_ids"], None, cache, padding_mask(source_ids[:4], 0)
        )
        np.testing.assert_allclose(outputs["logits"], np.asarray(keras_logits), atol=1e-4)
        for past, present in zip(past_names(layers), present_names(layers)):
            feed[past] = outputs[present]
    assert feed[past_names(layers)[0]].shape[2] == 2


def test_onnx_text_graph_matches_translate_cli(exported, sentences, cli_translations):
    from keras_transformer_export.parity import translate_in_subprocess

    # Text in, text out with onnxruntime-extensions, in a process without TensorFlow.
    assert translate_in_subprocess(str(exported[1]), sentences, "text") == cli_translations


def _tree_digest(path):
    digest = hashlib.sha256()
    for directory, _, files in sorted(os.walk(path)):
        for name in sorted(files):
            with open(os.path.join(directory, name), "rb") as handle:
                digest.update(name.encode() + handle.read())
    return digest.hexdigest()


def test_killed_export_leaves_no_visible_version(exported, trained_run):
    serving = exported[0]
    before = _tree_digest(serving / "tiny" / "1")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "keras_transformer.cli",
            "export",
            "--model",
            str(trained_run),
            "--format",
            "saved_model",
            "--out",
            str(serving),
            "--name",
            "tiny",
        ],
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 180
    while time.time() < deadline and process.poll() is None:
        partial = [e for e in os.listdir(serving / "tiny") if e.startswith(".partial-")]
        if partial and any(os.listdir(serving / "tiny" / partial[0])):  # writing has begun
            break
        time.sleep(0.05)
    assert process.poll() is None, "the export finished before it could be killed"
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert versions(serving / "tiny") == [1]
    assert _tree_digest(serving / "tiny" / "1") == before
    # What the killed export left is hidden from TF Serving, and the next
    # export removes it (`atomic_directory` calls `remove_abandoned`).
    assert [e for e in os.listdir(serving / "tiny") if e.startswith(".partial-")]
    remove_abandoned(str(serving / "tiny"))
    assert sorted(os.listdir(serving / "tiny")) == ["1"]


def test_existing_version_needs_overwrite(exported, trained_run, capsys):
    serving = exported[0]
    arguments = [
        "export",
        "--model",
        str(trained_run),
        "--format",
        "saved_model",
        "--out",
        str(serving),
        "--name",
        "tiny",
        "--version",
        "1",
    ]
    assert cli.main(arguments) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "already exists" in error[0] and "--overwrite" in error[0]


def test_mixed_precision_model_exports_float32():
    import keras

    import keras_transformer as kt
    from keras_transformer_export.graphs import TranslationGraphs

    mixed = kt.Transformer(kt.TransformerConfig.from_preset("tiny", vocab_size=300), dtype="mixed_bfloat16")
    mixed.build()
    tokenizer = kt.Tokenizer.train([f"sentence {i} with words" for i in range(200)], vocab_size=300)
    graphs = TranslationGraphs(mixed, tokenizer)
    assert graphs.model is not mixed
    assert {layer.compute_dtype for layer in graphs.model._flatten_layers()} == {"float32"}
    for a, b in zip(graphs.model.weights, mixed.weights):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b))
    source = np.array([[5, 6, 7, 3]], np.int32)
    logits = graphs.forward(source, np.array([[2, 5, 6]], np.int32))["logits"]
    assert logits.dtype == tf.float32
    cache = graphs.encode(source)
    assert all(t.dtype in (tf.float32, tf.bool) for t in cache.values())


def test_layout_helpers(tmp_path):
    with pytest.raises(UserError, match="not usable"):
        check_model_name("../escape")
    (tmp_path / "a" / "3").mkdir(parents=True)
    (tmp_path / "a" / "not-a-version").mkdir()
    (tmp_path / "empty").mkdir()
    assert versions(tmp_path / "a") == [3]
    with open(write_models_config(str(tmp_path)), encoding="utf-8") as handle:
        config = handle.read()
    assert 'name: "a"' in config and "empty" not in config
    # An abandoned partial export (its process is gone) is removed; a live one is kept.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "a" / f".partial-4-{dead.pid}-abc").mkdir()
    (tmp_path / "a" / f".partial-5-{os.getpid()}-abc").mkdir()
    remove_abandoned(str(tmp_path / "a"))
    assert sorted(os.listdir(tmp_path / "a")) == [f".partial-5-{os.getpid()}-abc", "3", "not-a-version"]


def test_cache_graph_names_follow_the_decoding_cache_contract():
    """`cache_names` (importable without TensorFlow) names `DecodingCache.flat`'s tensors in order:
    self-attention keys/values are the graphs' `past_*` inputs and `present_*` outputs, the
    cross-attention ones `cross_*`."""
    from keras_transformer.layers.decoding_cache import DecodingCache
    from keras_transformer_export import cache_names

    graph_kinds = [name.replace("past_", "self_") for name in cache_names.CACHE_INPUTS]
    assert graph_kinds == list(DecodingCache._fields)
    assert [name.replace("present_", "self_") for name in cache_names.CACHE_OUTPUTS] == list(
        DecodingCache._fields[:2]
    )
    cache = DecodingCache(*(tuple(f"{field}_{i}" for i in range(3)) for field in DecodingCache._fields))
    names = cache_names.cache_input_names(3)
    assert [name.replace("past_", "self_") for name in names] == cache.flat()
    assert cache_names.past_names(3) + cache_names.cross_names(3) == names


def test_xla_options_are_refused_where_they_do_not_apply(tmp_path, capsys):
    """`--xla` is a SavedModel option; its sizes need it and must be integers >= 1: one line each,
    before any model is loaded (the model path does not even exist)."""
    from keras_transformer_export.xla_serving import XlaBuckets

    missing = ["export", "--model", str(tmp_path / "none"), "--out", str(tmp_path / "out")]
    assert cli.main([*missing, "--format", "onnx", "--xla"]) == 2
    assert "--xla is for --format saved_model" in capsys.readouterr().err
    assert cli.main([*missing, "--format", "saved_model", "--xla-batch-sizes", "1,8"]) == 2
    assert "--xla-batch-sizes needs --xla" in capsys.readouterr().err
    for sizes in ("0,8", "1,a", ""):
        with pytest.raises(SystemExit):
            cli.main([*missing, "--format", "saved_model", "--xla", "--xla-source-lengths", sizes])
        assert "expected integers >= 1" in capsys.readouterr().err
    assert XlaBuckets((32, 1, 8, 8), (500, 16)).for_model(256) == XlaBuckets((1, 8, 32), (16, 256))
    with pytest.raises(UserError, match="XLA batch sizes must be integers >= 1"):
        XlaBuckets((), (16,)).for_model(256)


def test_an_ensemble_exports_and_every_runtime_decodes_it_as_keras(document_run, sentences, tmp_path, capsys):
    """`export --model A B`: every ONNX graph searches the members' mean distribution with the
    tokens of Keras's `Ensemble`; CTranslate2 refuses it, a SavedModel without `--name` too.
    (On `document_run`, whose group runs beside the longer `trained_run` group: conftest.py.)"""
    import shutil

    import keras

    from keras_transformer.training.run_directory import load_run_models
    from keras_transformer_export.cache_names import cache_layers
    from keras_transformer_export.parity import check_parity

    # A second member: the tiny run's model with other weights (same vocabulary, as `train
    # --tokenizer` would give it), in a run directory beside the first.
    second = tmp_path / "runs" / "second"
    shutil.copytree(document_run, second, ignore=shutil.ignore_patterns("checkpoints", "state", "*.lock"))
    first_model = keras.saving.load_model(document_run / "model.keras")
    rng = np.random.default_rng(7)
    first_model.set_weights([w * (1 + 0.2 * rng.standard_normal(w.shape)) for w in first_model.get_weights()])
    first_model.save(second / "model.keras")
    models = [str(document_run), str(second)]
    sentences = sorted(sentences, key=len)[:12]  # a one-epoch model runs long ones to the length limit

    ct2 = ["export", "--model", *models, "--format", "ctranslate2", "--out", str(tmp_path / "ct2")]
    assert cli.main(ct2) == 2 and "CTranslate2 has no ensembles" in capsys.readouterr().err
    assert not (tmp_path / "ct2").exists()

    onnx_dir, serving = tmp_path / "onnx", tmp_path / "serving"
    assert cli.main(["export", "--model", *models, "--format", "onnx", "--out", str(onnx_dir)]) == 0
    # A SavedModel of several models needs a name (no run's fits), refused before any work. Its
    # export is not repeated here (the suite's time): on the recipe's two models it gives Keras's
    # translations 1000/1000 (results/export_parity_multi30k_ensemble.json, docs/deployment.md).
    saved_model = ["export", "--model", *models, "--format", "saved_model", "--out", str(serving)]
    assert cli.main(saved_model) == 2 and "needs --name" in capsys.readouterr().err
    assert not serving.exists()
    model = json.loads((onnx_dir / "export.json").read_text())["model"]
    assert cache_layers(model) == 2 * (model["num_decoder_layers"] or model["num_layers"])
    assert len(model["ensemble"]) == 2

    run, ensemble = load_run_models(models)
    assert cache_layers(model) == sum(len(member.decoder.stack_layers) for member in ensemble.members)
    report = check_parity(ensemble, run.tokenizer(), sentences, onnx_dir=str(onnx_dir))
    assert set(report["runtimes"]) == {"onnx_full", "onnx_split", "onnx_lean", "onnx_text"}
    for name, found in report["runtimes"].items():
        assert found["identical"] == len(sentences), (name, found["first_difference"])
    assert report["max_logit_difference"] < 1e-4
    # ... and that logit check tells the ensemble from either member alone.
    source_ids = run.tokenizer().encode(sentences[:4], max_length=model["max_length"])
    inputs = {"source_ids": source_ids, "target_ids": np.full((4, 3), model["bos_id"], np.int32)}
    mean = np.asarray(ensemble(inputs))
    for member in ensemble.members:
        alone = np.asarray(keras.ops.log_softmax(member(inputs), axis=-1))
        assert np.max(np.abs(alone - mean)) > 1e-2

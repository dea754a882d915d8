"""Do the exported artifacts translate exactly like Keras?

`check_parity` translates the same sentences with the Keras model
(`keras_transformer.Translator`), the reloaded SavedModel's
`serving_default` (and its `translate_xla`, compiled by XLA, where `export --xla` wrote one),
and ONNX Runtime (`translate.onnx`, the
`encoder.onnx` + `decoder_step.onnx` pair, `translate_lean.onnx`, and `translate_text.onnx` in a
separate process without TensorFlow: see `keras_transformer_export.onnx_runtime.make_session`),
and compares `forward.onnx`'s logits with Keras's.
"""

import json
import os
import subprocess
import sys

import numpy as np
import tensorflow as tf

from keras_transformer.decoding import policy
from keras_transformer_export.onnx_runtime import OnnxTranslator, make_session


def check_parity(
    model,
    tokenizer,
    sentences,
    saved_model=None,
    onnx_dir=None,
    beam_size=policy.BEAM_SIZE,
    length_penalty=policy.LENGTH_PENALTY,
    keep_translations=False,
):
    """A report `{"sentences", "runtimes": {name: {"identical", "first_difference"}},
    "max_logit_difference"}`; with `keep_translations`, also `"translations": {name: texts}`
    (Keras's as `keras`).

    `identical` counts the translations equal to Keras's (the reference). `saved_model`: a
    SavedModel version directory, or the SavedModel already loaded (`tf.saved_model.load`), so
    that a caller checking in chunks loads it, and compiles `translate_xla`'s programs, once.
    """
    from keras_transformer.decoding.translator import Translator

    sentences = list(sentences)
    translator = Translator(model, tokenizer, beam_size=beam_size, length_penalty=length_penalty)
    reference, _ = translator.translate(sentences)
    outputs = {}
    if saved_model is not None:
        if isinstance(saved_model, (str, os.PathLike)):
            saved_model = tf.saved_model.load(os.fspath(saved_model))
        signatures = saved_model.signatures
        for name, key in (("saved_model", "serving_default"), ("saved_model_xla", "translate_xla")):
            if key in signatures:
                texts = signatures[key](text=tf.constant(sentences, tf.string))["translation"].numpy()
                outputs[name] = [t.decode("utf-8") for t in texts]
    report = {"sentences": len(sentences), "runtimes": {}}
    if onnx_dir is not None:
        for mode in ("full", "split", "lean"):
            outputs[f"onnx_{mode}"] = OnnxTranslator(onnx_dir, mode).translate(sentences)[0]
        outputs["onnx_text"] = translate_in_subprocess(onnx_dir, sentences, "text")
        report["max_logit_difference"] = max_logit_difference(
            model, tokenizer, onnx_dir, sentences, reference
        )
    for name, texts in outputs.items():
        differences = [i for i, (a, b) in enumerate(zip(reference, texts)) if a != b]
        report["runtimes"][name] = {
            "identical": len(sentences) - len(differences),
            "first_difference": None
            if not differences
            else {"index": differences[0], "keras": reference[differences[0]], name: texts[differences[0]]},
        }
    if keep_translations:
        report["translations"] = {"keras": list(reference), **outputs}
    return report


def translate_in_subprocess(onnx_dir, sentences, mode):
    """`OnnxTranslator(onnx_dir, mode).translate(sentences)[0]`, in a fresh Python without TensorFlow."""
    code = (
        "import json, sys; from keras_transformer_export.onnx_runtime import OnnxTranslator; "
        "sentences = json.load(sys.stdin); "
        f"print(json.dumps(OnnxTranslator(sys.argv[1], {mode!r}).translate(sentences)[0]))"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    completed = subprocess.run(
        [sys.executable, "-c", code, onnx_dir],
        input=json.dumps(sentences),
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if completed.returncode != 0:
        raise RuntimeError(
            f"ONNX Runtime ({mode}) failed with status {completed.returncode}:\n{completed.stderr[-2000:]}"
        )
    return json.loads(completed.stdout)


def hypotheses_in_subprocess(onnx_dir, requests, mode="text"):
    """`OnnxTranslator(onnx_dir, mode).translate_hypotheses(sentences, **options)` for each
    `(sentences, options)` of `requests`, in a fresh Python without TensorFlow (the text graph
    needs one): per request, per sentence, `[text, score, log_prob, alignment]` lists."""
    code = (
        "import json, sys; from keras_transformer_export.onnx_runtime import OnnxTranslator; "
        f"translator = OnnxTranslator(sys.argv[1], {mode!r}); "
        "print(json.dumps([translator.translate_hypotheses(s, **o) for s, o in json.load(sys.stdin)]))"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    completed = subprocess.run(
        [sys.executable, "-c", code, onnx_dir],
        input=json.dumps(requests),
        capture_output=True,
        text=True,
        env=env,
    )
    if completed.returncode != 0:
        raise RuntimeError(
            f"ONNX Runtime ({mode}) failed with status {completed.returncode}:\n{completed.stderr[-2000:]}"
        )
    return json.loads(completed.stdout)


def max_logit_difference(model, tokenizer, onnx_dir, sentences, targets):
    """Largest |logit| difference between `forward.onnx` and Keras, teacher-forced on `targets`."""
    from keras_transformer.data.tokenizer import BOS_ID

    source_ids = tokenizer.encode(
        tf.constant(sentences), max_length=model.config.max_length, pad_to_max_length=False
    ).numpy()
    target_ids = tokenizer.encode(
        tf.constant(targets), max_length=model.config.max_length - 1, add_eos=False, pad_to_max_length=False
    ).numpy()
    target_ids = np.concatenate([np.full((len(targets), 1), BOS_ID, np.int32), target_ids], axis=1)
    keras_logits = np.asarray(
        model({"source_ids": source_ids, "target_ids": target_ids}, training=False), np.float32
    )
    session = make_session(os.path.join(onnx_dir, "forward.onnx"))
    onnx_logits = session.run(["logits"], {"source_ids": source_ids, "target_ids": target_ids})[0]
    return float(np.max(np.abs(onnx_logits - keras_logits)))

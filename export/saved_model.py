"""String-in/string-out SavedModel for TF Serving, with beam search inside.

`export_saved_model` writes `DIR/<name>/<version>/` (TF Serving's layout,
atomically: `keras_transformer_export.layout`, with its warmup requests in
`assets.extra/tf_serving_warmup_requests`), `DIR/models.config` and
`DIR/batching_parameters.txt` (`keras_transformer_export.tf_serving`). The SavedModel holds
the model's variables, the SentencePiece model (as tf-text ops, which the
stock `tensorflow/serving` binary includes) and these signatures:

| signature         | inputs                             | outputs                                          |
|-------------------|------------------------------------|--------------------------------------------------|
| `serving_default` | `text` string (-1)                 | `translation` string (-1), `score` float32 (-1)  |
| `translate_ids`   | `source_ids` int32 (-1, -1)        | `target_ids` int32 (-1, -1), `scores` float32 (-1) |
| `score`           | `source`, `target` string (-1)     | `log_likelihood` float32 (-1)                    |
| `translate_with_options` | `text`, `target_prefix` string (-1), `suppress_sequences` string (-1), one scalar per `DecodingOptions` field | `translations`, `alignments` string (-1, n), `scores`, `log_probs` float32 (-1, n) |
| `translate_xla` (only with `xla=`) | `text` string (-1) | as `serving_default`; the search compiled by XLA on bucketed shapes (`keras_transformer_export.xla_serving`) |

`serving_default` and `translate_ids` decode with the export's options;
`translate_with_options` takes them per request (TF Serving needs every input
of a signature: docs/decoding.md shows a REST request with the defaults).

Loading needs only `tensorflow` and `tensorflow_text` (for its ops):

    import tensorflow as tf, tensorflow_text  # noqa: F401 (registers the SentencePiece ops)
    translate = tf.saved_model.load("exports/demo/1").signatures["serving_default"]
    translate(text=tf.constant(["A dog runs."]))["translation"]

Input handling in `serving_default` and `score`: invalid UTF-8 bytes become
U+FFFD; text is NFKC-normalized by the tokenizer; a source longer than the
model's `max_length` pieces is truncated to it (EOS kept last); a string with
no content (empty, spaces, tabs, control characters) translates to "" with
score 0, without a search. Every input gives exactly one output.
"""

import dataclasses
import os

import keras

from keras_transformer_export import xla_serving
from keras_transformer_export.graphs import TranslationGraphs, members
from keras_transformer_export.layout import (
    atomic_directory,
    check_model_name,
    next_version,
    write_models_config,
)
from keras_transformer_export.tf_serving import (
    warmup_requests,
    write_batching_parameters,
    write_warmup_requests,
)

SIGNATURES = (
    ("serving_default", "translate_text"),
    ("translate_ids", "translate_ids"),
    ("score", "score"),
    ("translate_with_options", "translate_with_options"),
)


def export_saved_model(graphs, out_dir, name, version=None, overwrite=False, xla=None):
    """Writes `graphs` (a `TranslationGraphs`) as `out_dir/name/version/`; returns that path.

    Args:
        graphs: the model, tokenizer and decoding settings to export.
        out_dir: the TF Serving base directory (`--model_base_path`'s parent).
        name: the model name (TF Serving's `model_name`).
        version: a positive integer; default one more than the highest there.
        overwrite: replace an existing version (else a `UserError`).
        xla: None, or the `XlaBuckets` of a `translate_xla` signature compiled by XLA (for
            TF Serving with `--xla_cpu_compilation_enabled=true`; its warmup records compile
            every bucket at load: `keras_transformer_export.xla_serving`).
    """
    if not isinstance(graphs, TranslationGraphs):
        raise TypeError(f"graphs must be a TranslationGraphs; got {graphs!r}.")
    check_model_name(name)
    if xla is not None:
        xla = xla.for_model(graphs.config.max_length)  # a bad bucket is refused before the work
    model_dir = os.path.join(out_dir, name)
    if version is None:
        version = next_version(model_dir)
    path = os.path.join(model_dir, str(int(version)))
    with atomic_directory(path, overwrite=overwrite) as temporary:
        archive = keras.export.ExportArchive()
        for member in members(graphs.model):  # an ensemble's every member
            archive.track(member)
        for signature, function in SIGNATURES:
            archive.add_endpoint(signature, graphs.function(function))
        requests = warmup_requests(graphs, name)
        if xla is not None:
            archive.add_endpoint(xla_serving.SIGNATURE, xla_serving.translate_xla_function(graphs, xla))
            requests += xla_serving.warmup_requests(graphs, name, xla)
        archive.write_out(temporary, verbose=False)
        extra = {} if xla is None else {"xla_buckets": dataclasses.asdict(xla)}
        graphs.write_assets(os.path.join(temporary, "assets.extra"), **extra)  # TF Serving ignores it
        write_warmup_requests(temporary, requests)
    write_models_config(out_dir)
    write_batching_parameters(out_dir)
    return path

"""What TF Serving reads beside a SavedModel: warmup requests and request-batching parameters.

**Warmup** (`--enable_model_warmup`, on by default in recent TF Serving): when a
version loads, TF Serving replays the `PredictionLog` records of
`<version>/assets.extra/tf_serving_warmup_requests` before it marks the version
available, so the first client request does not pay for the session's lazy
initialization (kernel selection, memory pools, the tf-text ops' first
SentencePiece load). `export_saved_model` writes one record per signature and
typical batch: a short sentence alone, a batch of 8 mixed lengths, a sentence
of the model's full length, the ids signature and the score signature.

**Batching** (`--enable_batching --batching_parameters_file=/models/batching_parameters.txt`):
TF Serving merges concurrent requests into one session run. The file written
next to `models.config` (`write_batching_parameters`) holds the numbers chosen
from `scripts/bench_serving.py --load` (docs/deployment.md, "Warmup and request
batching"): batches of up to 32 sentences (unbatched, 8 clients got 17.8
sentences/s from the `mini` SavedModel's session; batches of 32 gave 57.9), 2 ms
of waiting for a batch to fill (0.1% of the median latency under that load), and
TF Serving's default of one batch thread per core. Only
the string signatures batch safely: TF Serving pads `translate_ids` requests of
different lengths with their first element, not with the pad id, so send
`translate_ids` requests padded to one length, or use `serving_default`.
"""

import os

from keras_transformer.utils.files import atomic_write

WARMUP_FILE = "tf_serving_warmup_requests"
BATCHING_FILE = "batching_parameters.txt"

# Chosen from the load measurement (docs/deployment.md, "Under load"); see the module docstring.
BATCHING_PARAMETERS = {
    "max_batch_size": 32,
    "batch_timeout_micros": 2000,
    "max_enqueued_batches": 64,
}  # num_batch_threads: TF Serving's default, the server's cores

WARMUP_SENTENCES = (
    "A man is sleeping.",
    "Two dogs play in the snow.",
    "A group of people stand in front of an igloo while children in red jackets watch them.",
    "A woman.",
    "Three young boys are running across a green field toward a large white house near the lake.",
    "",
    "The cat sits.",
    "People are walking down a busy street in the city at night, past shops and restaurants.",
)


def predict_request(model_name, signature, **inputs):
    """A TF Serving `PredictRequest` for `signature` of `model_name`, with `inputs` (name -> array)."""
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2

    message = predict_pb2.PredictRequest()
    message.model_spec.name = model_name
    message.model_spec.signature_name = signature
    for name, value in inputs.items():
        message.inputs[name].CopyFrom(tf.make_tensor_proto(value))
    return message


def warmup_requests(graphs, model_name):
    """`PredictRequest`s for `graphs` (a `TranslationGraphs`) as TF Serving will receive them."""
    import numpy as np
    import tensorflow as tf

    from keras_transformer.decoding.translator import option_tensors

    def request(signature, **inputs):
        return predict_request(model_name, signature, **inputs)

    full_length = " ".join(["word"] * graphs.config.max_length)  # at least max_length pieces: cut
    source_ids = graphs.source_ids(tf.constant(list(WARMUP_SENTENCES[:4]))).numpy()
    return [
        request("serving_default", text=[WARMUP_SENTENCES[0]]),
        request("serving_default", text=list(WARMUP_SENTENCES)),
        request("serving_default", text=[full_length]),
        request("translate_ids", source_ids=source_ids),
        request("score", source=list(WARMUP_SENTENCES[:2]), target=list(WARMUP_SENTENCES[:2])),
        request(
            "translate_with_options",
            text=list(WARMUP_SENTENCES[:2]),
            target_prefix=["", ""],
            suppress_sequences=np.zeros((0,), object),
            **{name: value.numpy() for name, value in option_tensors(graphs.options).items()},
        ),
    ]


def write_warmup_requests(version_dir, requests):
    """Writes `requests` as TF Serving's warmup file under `version_dir/assets.extra`; its path."""
    import tensorflow as tf
    from tensorflow_serving.apis import prediction_log_pb2

    directory = os.path.join(version_dir, "assets.extra")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, WARMUP_FILE)
    with tf.io.TFRecordWriter(path) as writer:
        for message in requests:
            log = prediction_log_pb2.PredictionLog(predict_log=prediction_log_pb2.PredictLog(request=message))
            writer.write(log.SerializeToString())
    return path


def read_warmup_requests(version_dir):
    """The `PredictRequest`s of a version's warmup file, as TF Serving parses them."""
    import tensorflow as tf
    from tensorflow_serving.apis import prediction_log_pb2

    path = os.path.join(version_dir, "assets.extra", WARMUP_FILE)
    requests = []
    for record in tf.data.TFRecordDataset(path):
        log = prediction_log_pb2.PredictionLog.FromString(record.numpy())
        requests.append(log.predict_log.request)
    return requests


def write_batching_parameters(base_dir, parameters=None):
    """Writes `base_dir/batching_parameters.txt` (TF Serving's `BatchingParameters`, text format)."""
    parameters = {**BATCHING_PARAMETERS, **(parameters or {})}
    lines = [f"{name} {{ value: {value} }}" for name, value in parameters.items()]
    path = os.path.join(base_dir, BATCHING_FILE)
    atomic_write(
        path,
        "# TF Serving --batching_parameters_file; written by keras-transformer export\n"
        "# (keras_transformer_export.tf_serving explains the numbers).\n" + "\n".join(lines) + "\n",
    )
    return path


class ServingSession:
    """A SavedModel version run the way TF Serving runs it: loaded into a TF1 session
    (`SavedModelBundle`, tag `serve`), each signature run by its tensor names, XLA off.
    `Session.run` may be called from many threads at once, as a server does.

        session = ServingSession("exports/demo/1")
        session.run("serving_default", text=["A man is sleeping."])  # {"translation": ..., "score": ...}
        [session.predict(request) for request in read_warmup_requests("exports/demo/1")]
    """

    def __init__(self, version_dir, intra_op_threads=0):
        import tensorflow as tf
        import tensorflow_text  # noqa: F401  (registers the SentencePiece ops, as TF Serving links them)

        config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=intra_op_threads)
        config.graph_options.optimizer_options.global_jit_level = tf.compat.v1.OptimizerOptions.OFF
        self.graph = tf.Graph()
        self.session = tf.compat.v1.Session(graph=self.graph, config=config)
        with self.graph.as_default():
            meta_graph = tf.compat.v1.saved_model.loader.load(self.session, ["serve"], str(version_dir))
        self.signatures = dict(meta_graph.signature_def)

    def run(self, signature, **inputs):
        """The signature's outputs (NumPy) for `inputs` (name -> array-like)."""
        definition = self.signatures[signature]
        feed = {definition.inputs[name].name: value for name, value in inputs.items()}
        fetch = {name: tensor.name for name, tensor in definition.outputs.items()}
        return self.session.run(fetch, feed)

    def predict(self, request):
        """The outputs for a `PredictRequest` (a warmup record, or what a client sends)."""
        import tensorflow as tf

        inputs = {name: tf.make_ndarray(proto) for name, proto in request.inputs.items()}
        return self.run(request.model_spec.signature_name or "serving_default", **inputs)

    def close(self):
        self.session.close()

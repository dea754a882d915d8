"""Training speed, side by side in one run: our `Transformer` (batched and
per-head attention) against the same architecture built from keras-hub's
`TransformerEncoder` / `TransformerDecoder`, with and without XLA, on the same
Multi30k token batches; and the machine's limit, so that each speed is also a
model FLOP utilization (MFU).

Implementations: "ours batched" and "ours per-head" (`attention_mode`) train with
our `Transformer.train_step`, which computes the pre-softmax projection and the
loss together from the decoder output and skips padding
(`projected_smoothed_cross_entropy`); "ours logits" is "ours batched" trained by
Keras' own step on the `(batch, len, vocab)` logits, as the keras-hub build is,
to show what the fused step gives (not in the default run); "keras-hub" is the
build described below.

Models: `small` (3+3 layers, d_model 256, 4 heads, d_ff 1024), `base-2` (the
base widths: d_model 512, 8 heads, d_ff 2048, with 2+2 layers) and, with
`--models mini`, `mini` (4+4 layers, d_model 128, 4 heads, d_ff 256: the
Multi30k recipe's model until issue 30) and `mini-3` (the same with 3+3 layers:
the recipe's model now); a shared 8000-piece vocabulary tied to the output
projection in both builds, the preset's dropout (0.1; 0.3 for `mini`), the
paper's label-smoothed loss and Adam on the Noam schedule.

The machine's limit is the sustained float32 rate of repeated 2048x2048
matrix products (`tf.matmul`), measured at the start and at the end of the run.

Model FLOPs (multiply-adds x 2, backward = 2 x forward, so training = 6 x MACs),
counted from the architecture over the real (non-padding) tokens of each
batch, for a source of n_s tokens and a target of n_t tokens, width d, d_ff,
L layers per stack, vocabulary V:

    encoder, per layer:  n_s (4 d^2 + 2 d d_ff) + 2 n_s^2 d
    decoder, per layer:  n_t (4 d^2 + 2 d d_ff)  + 2 n_t^2 d          (self-attention, FFN)
                         + 2 n_t d^2 + 2 n_s d^2 + 2 n_t n_s d        (cross-attention)
    output projection:   n_t d V
    training FLOPs = 6 x (sum of the above)

(the attention products are counted in full, as they are computed; padding is
not counted). MFU = achieved model FLOP/s / the measured matmul rate (the higher
of the two measurements).

The batches: the first `--batches` batches of epoch 0 (4096 tokens each) that
have the epoch's most frequent shape, so XLA compiles one program per variant.
For each model size, every variant (implementation x XLA) is built and trains
one untimed pass over them (tracing, compilation); then the variants take
turns for `--repeats` timed passes each with `model.fit`, timing each step
from `on_train_batch_begin` to `on_train_batch_end`; a variant's step time is
the median over its passes of the mean step (all passes are in the JSON).
"vs keras-hub" is the ratio of the median step times; "rounds" is the range of
the ratios of passes timed in the same round (each round times every variant
once, in turn), which shows how much the machine's noise moves the ratio.

    python scripts/bench_train.py [--batches 4] [--repeats 5] [--mixed-precision]
                                  [--baseline REF] [--autoclustering]
                                  [--json results/bench_train.json]

`--baseline REF` (a commit, tag or branch) adds "ours batched @REF": the same
model built by that commit's library, each (XLA, policy) variant in a worker
process of its own that imports REF's tree (extracted with `git archive`); the
workers take their turns in the same rounds as the in-process variants, so the
old and new step are timed side by side in one run ("vs baseline" in the table).

`--autoclustering` adds "ours batched, autoclustered": the step without
`jit_compile`, in a worker process started with TensorFlow's XLA
auto-clustering of the fusible (elementwise) ops only (`TF_XLA_FLAGS` set to
`AUTOCLUSTERING` below), so that the matrix products keep TensorFlow's kernels
(oneDNN, faster than XLA's at these shapes: `scripts/bench_products.py`) while
XLA fuses the elementwise ops between them.

With `--mixed-precision` the models compute in bfloat16 (CPU) or float16 (GPU)
with float32 weights; `--policies float32,mixed` times both side by side in one
run. MFU stays relative to the float32 matmul rate.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import harness

BASELINE_TREE = "BENCH_TRAIN_LIBRARY_TREE"  # set in a baseline worker: import the library from here
AUTOCLUSTERING = "--tf_xla_auto_jit=2 --tf_xla_cpu_global_jit --tf_xla_ops_to_cluster=FUSIBLE"
AUTOCLUSTERED = "ours batched, autoclustered"
if os.environ.get(BASELINE_TREE):
    sys.path.insert(0, os.environ[BASELINE_TREE])

tf = harness.tensorflow()

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_transformer as kt  # noqa: E402
from keras_transformer.data.batching import TokenizedPairs  # noqa: E402
from keras_transformer.training.fused_step import FusedOutputLossStep  # noqa: E402
from keras_transformer.training.setup import mixed_precision_policy  # noqa: E402

IMPLEMENTATIONS = ("ours batched", "ours per-head", "ours logits", "keras-hub")
MODELS = {
    "small": dict(preset="small"),
    "base-2": dict(preset="base", num_layers=2),
    "mini": dict(preset="mini"),  # the Multi30k recipe's model until it went 3+3 (issue 30's baseline)
    "mini-3": dict(preset="mini", num_layers=3),  # the recipe's model until f56122c (d_ff 256)
    # The recipe's model since f56122c (scripts/reproduce_multi30k.sh): the paper's d_ff = 4 x d_model.
    "mini-3-ff512": dict(preset="mini", num_layers=3, d_ff=512),
}


def matmul_limit(size=2048, repeats=10, rounds=5):
    """Sustained float32 FLOP/s of `repeats` chained size x size products (best of `rounds`)."""
    a = tf.random.normal([size, size])
    b = tf.random.normal([size, size]) / size**0.5

    @tf.function
    def chain(x):
        for _ in range(repeats):
            x = tf.matmul(x, b)
        return tf.reduce_sum(x)

    chain(a).numpy()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        chain(a).numpy()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 * repeats / best


def batch_flops(source, labels, config):
    """Training FLOPs of one batch (see the module docstring), over real tokens."""
    d, d_ff, layers, vocab = config.d_model, config.d_ff, config.num_layers, config.target_vocab
    n_s = (source != 0).sum(axis=1).astype(np.float64)
    n_t = (labels != 0).sum(axis=1).astype(np.float64)
    encoder = layers * (n_s * (4 * d * d + 2 * d * d_ff) + 2 * n_s**2 * d)
    decoder = layers * (
        n_t * (4 * d * d + 2 * d * d_ff)
        + 2 * n_t**2 * d
        + 2 * n_t * d * d
        + 2 * n_s * d * d
        + 2 * n_t * n_s * d
    )
    return float(6 * np.sum(encoder + decoder + n_t * d * vocab))


def keras_hub_transformer(config):
    """The same architecture from keras-hub layers (post-norm, sinusoidal positions, tied embedding)."""
    import keras_hub

    source = keras.Input((None,), dtype="int32", name="source_ids")
    target = keras.Input((None,), dtype="int32", name="target_ids")
    embedding = keras_hub.layers.ReversibleEmbedding(
        config.vocab_size, config.d_model, tie_weights=True, name="embedding"
    )
    scale = keras.layers.Rescaling(config.d_model**0.5)
    positions = keras_hub.layers.SinePositionEncoding()

    def embed(ids, name):
        x = scale(embedding(ids))
        x = keras.layers.Add()([x, positions(x)])
        return keras.layers.Dropout(config.dropout_rate, name=f"{name}_dropout")(x)

    source_mask = keras.ops.not_equal(source, config.pad_id)
    target_mask = keras.ops.not_equal(target, config.pad_id)
    memory = embed(source, "source")
    layer_options = dict(
        intermediate_dim=config.d_ff,
        num_heads=config.num_heads,
        dropout=config.dropout_rate,
        layer_norm_epsilon=config.layer_norm_epsilon,
    )
    for index in range(config.num_layers):
        memory = keras_hub.layers.TransformerEncoder(**layer_options, name=f"encoder_{index}")(
            memory, padding_mask=source_mask
        )
    hidden = embed(target, "target")
    for index in range(config.num_layers):
        hidden = keras_hub.layers.TransformerDecoder(**layer_options, name=f"decoder_{index}")(
            hidden, memory, decoder_padding_mask=target_mask, encoder_padding_mask=source_mask
        )
    logits = embedding(hidden, reverse=True)
    return keras.Model({"source_ids": source, "target_ids": target}, logits, name="keras_hub")


def build(implementation, config, jit_compile):
    if implementation == "keras-hub":
        model = keras_hub_transformer(config)
    else:
        mode = "per_head" if implementation == "ours per-head" else "batched"
        model = kt.Transformer(config.replace(attention_mode=mode))
        # "ours logits": Keras' own step on the (batch, len, vocab) logits, as
        # keras-hub's build trains, instead of our fused projection + loss.
        model.fused_step = FusedOutputLossStep() if implementation != "ours logits" else None
    model.compile(
        optimizer=kt.make_optimizer(config.d_model, warmup_steps=4000),
        loss=kt.LabelSmoothedCrossEntropy(0.1, pad_id=config.pad_id),
        metrics=[kt.MaskedTokenAccuracy(pad_id=config.pad_id)],
        jit_compile=jit_compile,
    )
    return model


class StepTimer(keras.callbacks.Callback):
    """Wall time of each training step (from `on_train_batch_begin` to `_end`)."""

    def __init__(self):
        super().__init__()
        self.steps = []

    def on_train_batch_begin(self, batch, logs=None):
        self.start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append(time.perf_counter() - self.start)


def timed_pass(model, dataset):
    """Seconds of the training steps of one pass of `fit` over `dataset`."""
    timer = StepTimer()
    model.fit(dataset, epochs=1, verbose=0, shuffle=False, callbacks=[timer])
    return sum(timer.steps)


class BaselineWorker(harness.LineWorker):
    """One "ours batched" variant built by another commit's library (or this tree's with other
    `environment` variables), in a process of its own.

    The process (this script with `--worker`) imports the library from `tree`,
    builds the model on the batches saved in `batches_path`, trains its untimed
    pass (then `info`: parameters, compute dtype, library path), and then times one
    pass each time it is asked, so that its passes interleave with the in-process variants'.
    """

    def __init__(self, tree, batches_path, model_name, vocab_size, jit_compile, policy, environment=None):
        spec = dict(
            batches=str(batches_path), model=model_name, vocab_size=vocab_size, xla=jit_compile, policy=policy
        )
        super().__init__(__file__, spec, BASELINE_TREE, tree, environment)

    def timed_pass(self):
        return self.ask("pass")["seconds"]


def model_config(model_name, vocab_size):
    """The `TransformerConfig` of one of `MODELS`."""
    settings = dict(MODELS[model_name])
    return kt.TransformerConfig.from_preset(settings.pop("preset"), vocab_size=vocab_size, **settings)


def stacked(batches):
    """The batches (all of one shape) as arrays `source_ids`, `target_ids`, `labels`, one batch per row."""
    arrays = {key: np.stack([inputs[key] for inputs, _ in batches]) for key in ("source_ids", "target_ids")}
    return {**arrays, "labels": np.stack([labels for _, labels in batches])}


def batches_dataset(arrays):
    """The stacked batches as a cached in-memory dataset of `(inputs, labels)`."""
    inputs = {key: arrays[key] for key in ("source_ids", "target_ids")}
    return tf.data.Dataset.from_tensor_slices((inputs, arrays["labels"])).cache()


def serve_worker(spec):
    """The `--worker` side of `BaselineWorker`: one JSON line per request on stdout."""
    spec = json.loads(spec)
    dataset = batches_dataset(np.load(spec["batches"]))
    config = model_config(spec["model"], spec["vocab_size"])
    policy = mixed_precision_policy() if spec["policy"] != "float32" else "float32"
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(0)
    model = build("ours batched", config, spec["xla"])
    keras.config.set_dtype_policy("float32")
    model.fit(dataset, epochs=1, verbose=0, shuffle=False)
    info = dict(parameters=model.count_params(), compute_dtype=model.compute_dtype, library=kt.__file__)
    print(json.dumps(info), flush=True)
    for _ in sys.stdin:
        print(json.dumps(dict(seconds=timed_pass(model, dataset))), flush=True)


def time_passes(models, dataset, repeats):
    """Seconds of training steps per pass over `dataset` for each model, `repeats` passes each.

    Every model first trains one untimed pass (tracing, XLA compilation); the
    timed passes then take turns (model 1, model 2, ..., model 1, ...), so a
    busy spell on a shared machine slows all of them rather than one. Only the
    steps are timed, not `fit`'s start and end of epoch: on this machine the
    end of a `fit` epoch sometimes waited until the next power-of-two multiple
    of 10 ms since the epoch began (10.24 s, 20.48 s, ...), which would hide
    the steps' speed.
    """
    for model in models.values():
        if not isinstance(model, BaselineWorker):  # a worker trained its untimed pass at start
            model.fit(dataset, epochs=1, verbose=0, shuffle=False)
    passes = {key: [] for key in models}
    for _ in range(repeats):
        for key, model in models.items():
            seconds = model.timed_pass() if isinstance(model, BaselineWorker) else timed_pass(model, dataset)
            passes[key].append(seconds)
    return passes


def load_batches(count, batch_tokens, data_dir):
    corpus = kt.load_corpus("multi30k", data_dir=data_dir)
    sources, targets = corpus["train"]
    tokenizer = kt.Tokenizer.train(sources + targets, vocab_size=8000)
    pairs = TokenizedPairs.from_texts(sources, targets, tokenizer, batch_tokens=batch_tokens, max_length=128)
    batches = [
        ({k: v.numpy() for k, v in inputs.items()}, labels.numpy())
        for inputs, labels in pairs.epoch(0, seed=0)
    ]
    # The most frequent batch shape only: XLA compiles one program per shape,
    # and compiling a dozen shapes per variant would dominate the run.
    shapes = [labels.shape for _, labels in batches]
    common = max(set(shapes), key=shapes.count)
    return tokenizer.vocab_size, [batch for batch in batches if batch[1].shape == common][:count]


def main():
    parser = harness.parser(__doc__, "bench_train")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    harness.add_data_dir(parser)
    parser.add_argument("--models", default="small,base-2")
    parser.add_argument(
        "--implementations",
        default="ours batched,ours per-head,keras-hub",
        help=f"comma-separated, from {', '.join(IMPLEMENTATIONS)}",
    )
    parser.add_argument(
        "--mixed-precision",
        action="store_true",
        help="mixed_float16 on a GPU, mixed_bfloat16 on CPU (as `train --mixed-precision`); "
        "same as --policies mixed",
    )
    parser.add_argument(
        "--policies",
        default=None,
        help="comma-separated dtype policies timed side by side in one run: float32, mixed "
        "(mixed_float16 on a GPU, mixed_bfloat16 on CPU); default float32",
    )
    parser.add_argument(
        "--baseline",
        metavar="REF",
        help='also time "ours batched" as commit REF builds it, side by side (see above)',
    )
    parser.add_argument(
        "--autoclustering",
        action="store_true",
        help=f'also time "{AUTOCLUSTERED}" (no jit_compile; XLA auto-clustering of the fusible ops)',
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # a baseline worker's spec (internal)
    args = parser.parse_args()
    if args.worker:
        return serve_worker(args.worker)
    names = (args.policies or ("mixed" if args.mixed_precision else "float32")).split(",")
    if set(names) - {"float32", "mixed"}:
        parser.error(f"--policies: choose from float32, mixed; got {args.policies!r}")
    unknown = sorted(set(args.implementations.split(",")) - set(IMPLEMENTATIONS))
    if unknown:
        parser.error(f"--implementations: unknown {unknown}; choose from {list(IMPLEMENTATIONS)}")

    policies = [mixed_precision_policy() if name == "mixed" else "float32" for name in names]
    limit_start = matmul_limit()
    print(f"Matmul limit (float32, 2048x2048): {limit_start / 1e9:.1f} GFLOP/s", flush=True)
    vocab_size, batches = load_batches(args.batches, args.batch_tokens, args.data_dir)
    target_tokens = sum(int((labels != 0).sum()) for _, labels in batches)

    arrays = stacked(batches)  # for the in-process dataset and the baseline workers' file
    scratch = tempfile.TemporaryDirectory(prefix="bench_train_")
    baseline = None
    batches_path = Path(scratch.name) / "batches.npz"  # the workers' batches
    if args.baseline or args.autoclustering:
        np.savez(batches_path, **arrays)
    if args.baseline:
        tree = Path(scratch.name) / "baseline"
        tree.mkdir()
        baseline = f"ours batched @{harness.extract_tree(args.baseline, tree)}"

    rows = []
    for model_name in args.models.split(","):
        config = model_config(model_name, vocab_size)
        flops = sum(batch_flops(inputs["source_ids"], labels, config) for inputs, labels in batches)
        models = {}
        for policy in policies:
            keras.config.set_dtype_policy(policy)  # the layers take it when they are made
            for jit_compile in (False, True):
                for implementation in args.implementations.split(","):
                    keras.utils.set_random_seed(0)
                    models[implementation, jit_compile, policy] = build(implementation, config, jit_compile)
        keras.config.set_dtype_policy("float32")
        if args.autoclustering:
            for policy in policies:
                models[AUTOCLUSTERED, False, policy] = BaselineWorker(
                    harness.ROOT,
                    batches_path,
                    model_name,
                    vocab_size,
                    False,
                    policy,
                    environment={"TF_XLA_FLAGS": AUTOCLUSTERING},
                )
        if baseline:
            for policy in policies:
                for jit_compile in (False, True):
                    models[baseline, jit_compile, policy] = BaselineWorker(
                        tree, batches_path, model_name, vocab_size, jit_compile, policy
                    )
        passes = time_passes(models, batches_dataset(arrays), args.repeats)
        for (implementation, jit_compile, policy), seconds in passes.items():
            step = float(np.median(seconds)) / len(batches)
            model = models[implementation, jit_compile, policy]
            info = model.info if isinstance(model, BaselineWorker) else None
            row = dict(
                model=model_name,
                implementation=implementation,
                xla=jit_compile,
                dtype_policy=policy,
                parameters=info["parameters"] if info else model.count_params(),
                compute_dtype=info["compute_dtype"] if info else model.compute_dtype,
                step_ms=step * 1e3,
                step_ms_passes=[s / len(batches) * 1e3 for s in seconds],
                target_tokens_per_s=target_tokens / len(batches) / step,
                flops_per_target_token=flops / target_tokens,
                gflops_per_s=flops / len(batches) / step / 1e9,
            )
            rows.append(row)
            print(
                f"  {model_name:<7} {implementation:<14} xla={jit_compile!s:<5} {policy:<14} "
                f"{row['step_ms']:8.1f} ms/step {row['target_tokens_per_s']:8.0f} tok/s",
                flush=True,
            )  # MFU in the final table, against both matmul measurements
        for model in models.values():
            if isinstance(model, BaselineWorker):
                model.close()
        del models
        keras.backend.clear_session()
    scratch.cleanup()
    limit_end = matmul_limit()
    print(f"Matmul limit at the end: {limit_end / 1e9:.1f} GFLOP/s\n")
    report(rows, limit_start, limit_end, target_tokens, len(batches), policies, args, baseline)


def same_variant_ratios(row, rows, implementation):
    """`(ratio, per-round ratios)` of `row`'s speed to `implementation`'s at the same model,
    XLA and policy (None where that implementation was not timed or is `row` itself)."""
    other = [
        r
        for r in rows
        if (r["model"], r["xla"], r["dtype_policy"], r["implementation"])
        == (row["model"], row["xla"], row["dtype_policy"], implementation)
    ]
    if not other or row["implementation"] == implementation:
        return None, []
    ratio = row["target_tokens_per_s"] / other[0]["target_tokens_per_s"]
    # Same-round ratios: the other's pass i over this variant's pass i (timed in one round).
    return ratio, [o / r for o, r in zip(other[0]["step_ms_passes"], row["step_ms_passes"])]


def report(rows, limit_start, limit_end, target_tokens, batches, policies, args, baseline=None):
    limit = max(limit_start, limit_end)  # the higher measurement: the conservative MFU
    table = []
    for row in rows:
        row["mfu"] = row["gflops_per_s"] * 1e9 / limit
        row["vs_keras_hub"], row["vs_keras_hub_rounds"] = same_variant_ratios(row, rows, "keras-hub")
        row["vs_baseline"], row["vs_baseline_rounds"] = same_variant_ratios(row, rows, baseline)

        def ratio_cells(ratio, rounds):
            span = f"{min(rounds):.2f}-{max(rounds):.2f}" if rounds else ""
            return [f"{ratio:.2f}x" if ratio else "—", span]

        table.append(
            [
                row["model"],
                row["implementation"],
                "yes" if row["xla"] else "no",
                row["dtype_policy"],
                f"{row['step_ms']:.0f}",
                f"{row['target_tokens_per_s']:.0f}",
                *ratio_cells(row["vs_keras_hub"], row["vs_keras_hub_rounds"]),
                *(ratio_cells(row["vs_baseline"], row["vs_baseline_rounds"]) if baseline else []),
                f"{row['flops_per_target_token'] / 1e9:.3f}",
                f"{row['gflops_per_s']:.1f}",
                f"{row['mfu']:.0%}",
            ]
        )
    harness.print_table(
        [
            "model",
            "implementation",
            "XLA",
            "policy",
            "step (ms)",
            "target tokens/s",
            "vs keras-hub",
            "rounds",
            *(["vs baseline", "rounds"] if baseline else []),
            "GFLOP/token",
            "GFLOP/s",
            "MFU",
        ],
        table,
    )
    harness.write_report(
        args.json,
        settings=vars(args),
        rows=rows,
        matmul_gflops_start=limit_start / 1e9,
        matmul_gflops_end=limit_end / 1e9,
        batches=batches,
        target_tokens=target_tokens,
        dtype_policies=policies,
        baseline=baseline,
    )


if __name__ == "__main__":
    main()

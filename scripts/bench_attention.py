"""Forward+backward time of multi-head attention: ours batched, ours per-head,
and keras.layers.MultiHeadAttention, with and without XLA, side by side.

Self-attention over (batch, length, d_model) = (32, 64, 512) with 8 heads and a
padding mask, dropout off, gradients for the inputs and all weights. The
variants run in interleaved rounds (machine noise hits them alike); the table
reports the median time per step, the ratio to Keras' layer without XLA, and
achieved GFLOP/s (matrix products only: 4 projections + 2 attention products,
forward x3 for forward+backward).

    python scripts/bench_attention.py [--rounds 7] [--iterations 5] [--json PATH]
"""

import statistics

import harness

tf = harness.tensorflow()

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_transformer as kt  # noqa: E402


def attention_flops(batch, length, d_model):
    projections = 4 * 2 * batch * length * d_model * d_model
    products = 2 * 2 * batch * length * length * d_model
    return 3 * (projections + products)  # forward + backward (2x forward)


def make_step(layer, inputs, mask, jit_compile):
    variables = None

    @tf.function(jit_compile=jit_compile)
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            outputs = layer(x, x, attention_mask=mask, training=True)
            loss = tf.reduce_sum(tf.square(outputs))
        return tape.gradient(loss, [x] + variables)

    layer(inputs, inputs)
    variables = list(layer.trainable_variables)
    return step


def main():
    parser = harness.parser(__doc__, "bench_attention")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iterations", type=int, default=5)
    args = parser.parse_args()

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    inputs = tf.constant(rng.normal(size=(args.batch, args.length, args.d_model)).astype("float32"))
    lengths = rng.integers(args.length // 2, args.length + 1, size=args.batch)
    mask = tf.constant(
        (np.arange(args.length)[None, :] < lengths[:, None])[:, None, :].repeat(args.length, axis=1)
    )  # (batch, length, length)

    layers = {
        "kt batched": kt.MultiHeadAttention(args.heads, args.d_model, mode="batched"),
        "kt per_head": kt.MultiHeadAttention(args.heads, args.d_model, mode="per_head"),
        "keras MultiHeadAttention": keras.layers.MultiHeadAttention(args.heads, args.d_model // args.heads),
    }
    steps = {}
    for name, layer in layers.items():
        for xla in (False, True):
            step = make_step(layer, inputs, mask, xla)
            for _ in range(2):  # trace/compile + warm-up
                step(inputs)
            steps[(name, xla)] = step

    calls = {key: (lambda step=step: step(inputs)[0].numpy()) for key, step in steps.items()}
    times = harness.interleaved(calls, args.rounds, args.iterations)

    flops = attention_flops(args.batch, args.length, args.d_model)
    baseline = statistics.median(times[("keras MultiHeadAttention", False)])
    rows = []
    for (name, xla), samples in times.items():
        median = statistics.median(samples)
        rows.append(
            dict(
                implementation=name,
                xla=xla,
                median_ms=median * 1e3,
                min_ms=min(samples) * 1e3,
                speedup_vs_keras=baseline / median,
                gflops=flops / median / 1e9,
            )
        )
    print(
        f"\nForward+backward, self-attention (batch {args.batch}, length {args.length}, "
        f"d_model {args.d_model}, {args.heads} heads), median of {args.rounds} rounds x "
        f"{args.iterations} steps\n"
    )
    harness.print_table(
        ["implementation", "XLA", "median ms", "min ms", "vs Keras MHA", "GFLOP/s"],
        [
            [
                row["implementation"],
                "yes" if row["xla"] else "no",
                f"{row['median_ms']:.1f}",
                f"{row['min_ms']:.1f}",
                f"{row['speedup_vs_keras']:.2f}x",
                f"{row['gflops']:.1f}",
            ]
            for row in rows
        ],
    )
    harness.write_report(args.json, settings=vars(args), flops_per_step=flops, results=rows)


if __name__ == "__main__":
    main()

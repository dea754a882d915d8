"""Where the training step's matrix-product time goes: every product of one step
of the Multi30k recipe's model, timed alone at its own shape, with TensorFlow's
kernels (oneDNN) and under XLA, in float32 and bfloat16.

The step (issue 30 asks for 1.5x its tokens/s) is mostly matrix products, at
d_model 128 small ones. This script lists them for one batch of the shape
`bench_train.py` times (the epoch's most frequent 4096-token shape): per layer
the Q/K/V, attention-output, cross-attention and feed-forward projections over
the padded positions (the layers compute padding), the attention scores and
context as batched products over `batch x heads`, and the tied pre-softmax
projection over the real target positions in the fused loss's 256-position
chunks (it skips padding). Each product is timed the three ways training runs
it: forward `a @ b`, the gradient of `a` (`g @ b^T`) and of `b` (`a^T @ g`).
All variants are timed in turns (`harness.interleaved`), each the median of
`--rounds` samples. Each product is one `tf.function` call, so a time includes
the call's dispatch (tens of microseconds): the attention products, 16 MFLOP
each, are mostly that; inside the step they run in one graph.

The summary adds up, for each of the four set-ups, the seconds the step's
products take at the rates measured here, beside the floor (the step's product
FLOPs at the float32 2048x2048 rate, `bench_train.matmul_limit`): it says how
much of a step is products and how fast a step could be if nothing else took
time.

    python scripts/bench_products.py [--layers 3] [--rounds 7]
        [--json results/bench_products_mini.json]
"""

import inspect
import statistics

import harness
from bench_train import load_batches, matmul_limit, model_config

from keras_transformer.training.losses import projected_smoothed_cross_entropy

tf = harness.tensorflow()
tf.get_logger().setLevel("ERROR")  # one tf.function per shape and way: the retracing warnings say nothing

SETUPS = (
    ("TensorFlow", False, "float32"),
    ("TensorFlow", False, "bfloat16"),
    ("XLA", True, "float32"),
    ("XLA", True, "bfloat16"),
)
# The fused loss's positions per chunk, as the training step calls it (its default).
CHUNK = inspect.signature(projected_smoothed_cross_entropy).parameters["chunk_size"].default


def step_products(config, rows, source_length, target_length, real_targets):
    """`{name: (batch, m, k, n, count)}`: each product `(batch, m, k) x (batch, k, n)` of one
    training step's forward pass, `count` times per step (equal shapes merged)."""
    d, heads, d_ff, layers = config.d_model, config.num_heads, config.d_ff, config.num_layers
    n_s, n_t, d_head = rows * source_length, rows * target_length, d // heads
    products = {}

    def add(name, batch, m, k, n, count):
        key = (batch, m, k, n)
        names, total = products.get(key, ((), 0))
        products[key] = (names + (name,), total + count)

    add("encoder Q/K/V", 1, n_s, d, 3 * d, layers)
    add("decoder Q/K/V", 1, n_t, d, 3 * d, layers)
    add("encoder attention output", 1, n_s, d, d, layers)
    add("decoder attention outputs, cross Q", 1, n_t, d, d, 3 * layers)
    add("cross K/V", 1, n_s, d, 2 * d, layers)
    add("encoder FFN in", 1, n_s, d, d_ff, layers)
    add("encoder FFN out", 1, n_s, d_ff, d, layers)
    add("decoder FFN in", 1, n_t, d, d_ff, layers)
    add("decoder FFN out", 1, n_t, d_ff, d, layers)
    add("encoder scores", rows * heads, source_length, d_head, source_length, layers)
    add("encoder context", rows * heads, source_length, source_length, d_head, layers)
    add("decoder scores", rows * heads, target_length, d_head, target_length, layers)
    add("decoder context", rows * heads, target_length, target_length, d_head, layers)
    add("cross scores", rows * heads, target_length, d_head, source_length, layers)
    add("cross context", rows * heads, target_length, source_length, d_head, layers)
    add(f"pre-softmax ({CHUNK}-position chunks)", 1, CHUNK, d, config.target_vocab, -(-real_targets // CHUNK))
    return {" / ".join(names): (*key, count) for key, (names, count) in products.items()}


def timed_ways(batch, m, k, n, jit_compile, dtype):
    """Callables for the forward product and its two gradient products at this shape."""
    shape = (lambda *dims: dims) if batch == 1 else (lambda *dims: (batch, *dims))
    a = tf.cast(tf.random.normal(shape(m, k)), dtype)
    b = tf.cast(tf.random.normal(shape(k, n)), dtype)
    g = tf.cast(tf.random.normal(shape(m, n)), dtype)
    forward = tf.function(lambda a, b: tf.matmul(a, b), jit_compile=jit_compile)
    grad_a = tf.function(lambda g, b: tf.matmul(g, b, transpose_b=True), jit_compile=jit_compile)
    grad_b = tf.function(lambda a, g: tf.matmul(a, g, transpose_a=True), jit_compile=jit_compile)
    ways = {"forward": lambda: forward(a, b), "grad a": lambda: grad_a(g, b), "grad b": lambda: grad_b(a, g)}
    for way in ways.values():
        way().numpy()  # trace, compile
    return ways  # a call returns once the product is computed (eager execution on the CPU is synchronous)


def main():
    parser = harness.parser(__doc__, "bench_products_mini")
    parser.add_argument("--layers", type=int, default=3, help="layers per stack (the recipe: 3)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    harness.add_data_dir(parser)
    args = parser.parse_args()

    vocab_size, batches = load_batches(1, args.batch_tokens, args.data_dir)
    inputs, labels = batches[0]
    rows, source_length = inputs["source_ids"].shape
    target_length = labels.shape[1]
    real_targets = int((labels != 0).sum())
    config = model_config("mini", vocab_size)
    config = config.replace(num_layers=args.layers)
    products = step_products(config, rows, source_length, target_length, real_targets)
    print(
        f"mini, {args.layers}+{args.layers} layers, batch {rows} x {source_length} source / {target_length} "
        f"target tokens ({real_targets} real target tokens)",
        flush=True,
    )

    functions = {}
    for name, (batch, m, k, n, _) in products.items():
        for label, jit_compile, dtype in SETUPS:
            for way, function in timed_ways(batch, m, k, n, jit_compile, dtype).items():
                functions[name, label, dtype, way] = function
    limit = matmul_limit()
    samples = harness.interleaved(functions, args.rounds, iterations=3)
    seconds = {key: statistics.median(values) for key, values in samples.items()}

    table, report_rows, totals = [], [], {(label, dtype): 0.0 for label, _, dtype in SETUPS}
    step_flops = 0.0
    for name, (batch, m, k, n, count) in products.items():
        flops = 2.0 * batch * m * k * n  # one way
        step_flops += 3 * flops * count
        shape = (f"{batch} x " if batch > 1 else "") + f"{m}x{k}x{n}"
        cells = [name, shape, str(count), f"{3 * flops * count / 1e9:.2f}"]
        rates = {}
        for label, _, dtype in SETUPS:
            way_seconds = {way: seconds[name, label, dtype, way] for way in ("forward", "grad a", "grad b")}
            totals[label, dtype] += sum(way_seconds.values()) * count
            rates[f"{label} {dtype}"] = {way: flops / s / 1e9 for way, s in way_seconds.items()}
            cells.append("/".join(f"{rate:.0f}" for rate in rates[f"{label} {dtype}"].values()))
        table.append(cells)
        report_rows.append(dict(product=name, batch=batch, m=m, k=k, n=n, per_step=count, gflops_per_s=rates))
    harness.print_table(
        [
            "product",
            "shape (batch x m x k x n)",
            "per step",
            "GFLOP per step (3 ways)",
            *(f"{label} {dtype} GFLOP/s (fwd/grad a/grad b)" for label, _, dtype in SETUPS),
        ],
        table,
    )
    print(
        f"\nThe step's products: {step_flops / 1e9:.1f} GFLOP; at the float32 2048x2048 rate "
        f"({limit / 1e9:.0f} GFLOP/s) {step_flops / limit * 1e3:.0f} ms"
    )
    summary = []
    for (label, dtype), total in totals.items():
        summary.append([label, dtype, f"{total * 1e3:.0f}", f"{step_flops / total / 1e9:.0f}"])
    harness.print_table(["kernels", "dtype", "ms per step in products", "GFLOP/s over them"], summary)
    harness.write_report(
        args.json,
        command=f"python scripts/bench_products.py --layers {args.layers} --rounds {args.rounds}",
        model=config.to_dict(),
        batch=dict(
            rows=rows,
            source_length=source_length,
            target_length=target_length,
            real_target_tokens=real_targets,
        ),
        matmul_limit_gflops=limit / 1e9,
        step_product_gflops=step_flops / 1e9,
        ms_in_products={f"{label} {dtype}": total * 1e3 for (label, dtype), total in totals.items()},
        products=report_rows,
    )


if __name__ == "__main__":
    main()

"""Decoding speed, side by side in one run: greedy and beam 4, with the KV cache
(graph and XLA), without it (the decoder re-run over the whole prefix every
step, as the TensorFlow tutorial and keras.io examples do), and keras-hub's
GreedySampler / BeamSampler driving the same model's cached decoding step.

The `small` preset (random weights, 8000-token vocabulary), EOS suppressed
so every output has exactly the requested length; batch 1 and 32, output
lengths 16, 32, 64. Reported: sentences/s and generated tokens/s (per
sentence, the best beam counts once), and the speed-up of the cache.

Notes on keras-hub: its samplers take a `next(prompt, cache, index)` function;
we pass ours (`Transformer.decode_step`), so the comparison is of the search
loops over the same model. keras-hub's BeamSampler gathers every cache entry
by beam each step (cross-attention keys/values included) and has no length
penalty; ours reorders only the self-attention cache.

    python scripts/bench_decoding.py [--batches 1 32] [--lengths 16 32 64] [--json PATH]
"""

import harness

tf = harness.tensorflow()

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_transformer as kt  # noqa: E402


def ours(model, search, length, use_cache, xla):
    def decode(source):
        if search == "greedy":
            return kt.greedy_search(
                model, source, max_length=length, min_length=length, use_cache=use_cache
            ).ids
        return kt.beam_search(
            model, source, beam_size=4, max_length=length, min_length=length, use_cache=use_cache
        ).ids

    return tf.function(decode, jit_compile=xla)


def keras_hub(model, search, length, xla):
    import keras_hub

    beams = 1 if search == "greedy" else 4
    sampler = (
        keras_hub.samplers.GreedySampler()
        if search == "greedy"
        else keras_hub.samplers.BeamSampler(num_beams=beams)
    )

    def decode(source):
        memory = model.encode(source)
        memory_mask = kt.padding_mask(source)
        if beams > 1:
            memory_mask = tf.repeat(memory_mask, beams, axis=0)
        cache = model.init_cache(memory, length)
        batch = tf.shape(source)[0]
        prompt = tf.concat(
            [tf.fill((batch, 1), model.config.bos_id), tf.zeros((batch, length), tf.int32)], axis=1
        )  # BOS + length tokens
        mask = tf.concat([tf.ones((batch, 1), tf.bool), tf.zeros((batch, length), tf.bool)], axis=1)

        def next_fn(prompt, cache, index):
            logits, cache = model.decode_step(prompt[:, index - 1], index - 1, cache, memory_mask)
            return logits, None, cache

        return sampler(next_fn, prompt, cache=cache, index=1, mask=mask)

    return tf.function(decode, jit_compile=xla)


def time_it(function, source, min_seconds, min_runs):
    function(source)  # trace / compile
    return harness.median_seconds(lambda: np.asarray(function(source)), min_runs, min_seconds)


def main():
    parser = harness.parser(__doc__, "bench_decoding")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--source-length", type=int, default=20)
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--min-seconds", type=float, default=2.0)
    parser.add_argument("--min-runs", type=int, default=2)
    parser.add_argument("--no-keras-hub", action="store_true")
    args = parser.parse_args()

    keras.utils.set_random_seed(0)
    model = kt.Transformer.from_preset("small", vocab_size=args.vocab_size)
    rng = np.random.default_rng(0)
    variants = [
        ("ours, cache", dict(use_cache=True, xla=False)),
        ("ours, cache, XLA", dict(use_cache=True, xla=True)),
        ("ours, no cache", dict(use_cache=False, xla=False)),
    ]
    if not args.no_keras_hub:
        variants.append(("keras-hub sampler, cache", dict(keras_hub=True, xla=False)))
    rows, table = [], []
    for search in ("greedy", "beam4"):
        for batch in args.batches:
            source = tf.constant(rng.integers(4, args.vocab_size, size=(batch, args.source_length)), tf.int32)
            for length in args.lengths:
                cells, seconds = [], {}
                for name, options in variants:
                    if options.get("keras_hub"):
                        function = keras_hub(model, search.rstrip("4"), length, options["xla"])
                    else:
                        function = ours(
                            model, search.rstrip("4"), length, options["use_cache"], options["xla"]
                        )
                    seconds[name] = time_it(function, source, args.min_seconds, args.min_runs)
                    rows.append(
                        dict(
                            search=search,
                            batch=batch,
                            length=length,
                            variant=name,
                            seconds=seconds[name],
                            sentences_per_s=batch / seconds[name],
                            tokens_per_s=batch * length / seconds[name],
                        )
                    )
                    cells.append(
                        f"{batch / seconds[name]:.1f} sent/s, {batch * length / seconds[name]:.0f} tok/s"
                    )
                speedup = seconds["ours, no cache"] / seconds["ours, cache"]
                hub = (
                    f"{seconds['keras-hub sampler, cache'] / seconds['ours, cache']:.2f}x"
                    if "keras-hub sampler, cache" in seconds
                    else "-"
                )
                table.append([search, batch, length, *cells, f"{speedup:.1f}x", hub])
                print(f"  {search} batch {batch} length {length}: {', '.join(cells)}", flush=True)
    names = [name for name, _ in variants]
    harness.print_table(["search", "batch", "length", *names, "cache speed-up", "ours/keras-hub"], table)
    harness.write_report(args.json, settings=vars(args), results=rows)


if __name__ == "__main__":
    main()

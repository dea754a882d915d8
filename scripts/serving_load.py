"""Serving under load: one session shared by client threads, each sending requests of mixed
lengths and batch sizes one after another (closed loop), as a server's handler threads would.

`run_load(translate, requests, threads)` first sends every request alone (the reference
outputs and the single-stream speed), then all of them from `threads` threads at once, and
reports errors, how many responses equal the same request's response alone, latency
percentiles and throughput. `scripts/bench_serving.py --load N` runs this file as a worker
process for each runtime, as a server runs one model: the SavedModel through TF Serving's
session path (`--saved-model VERSION_DIR`: `serving_default`, then `translate_xla` after the
version's warmup records, as TF Serving replays them at load, in the same session),
`translate.onnx` (`--onnx`, `OnnxTranslator`) and `translate_text.onnx` (`--onnx-text`): ONNX
Runtime from a process without TensorFlow, as the runtime install serves it (the text graph
needs one). The output is a JSON object: the report, or (`--saved-model`) a report per signature.

    python scripts/serving_load.py (--saved-model VERSION_DIR | --onnx EXPORT_DIR |
        --onnx-text EXPORT_DIR) [--threads 8] [--runtime-threads 2] < requests.json
"""

import argparse
import concurrent.futures
import json
import sys
import time

import numpy as np


def make_requests(sentences, count, seed=0, largest=8):
    """`count` requests of 1 to `largest` sentences drawn from `sentences` (mixed lengths)."""
    rng = np.random.default_rng(seed)
    return [[str(s) for s in rng.choice(sentences, size=rng.integers(1, largest + 1))] for _ in range(count)]


def run_load(translate, requests, threads):
    """The load report of `translate` (a list of str -> a list of str, thread-safe)."""
    start = time.perf_counter()
    alone = [translate(request) for request in requests]
    alone_seconds = time.perf_counter() - start

    def timed(request):
        tick = time.perf_counter()
        try:
            return translate(request), time.perf_counter() - tick, None
        except Exception as error:  # counted, not raised: the report says how many
            return None, time.perf_counter() - tick, repr(error)

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        together = list(pool.map(timed, requests))
    seconds = time.perf_counter() - start
    latencies = np.array([took for _, took, _ in together]) * 1000
    sentences = sum(len(r) for r in requests)
    errors = [error for _, _, error in together if error]
    return {
        "requests": len(requests),
        "sentences": sentences,
        "threads": threads,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "identical_to_alone": sum(out == ref for (out, _, _), ref in zip(together, alone)),
        "p50_ms": float(np.percentile(latencies, 50)),
        "p99_ms": float(np.percentile(latencies, 99)),
        "sentences_per_s": sentences / seconds,
        "requests_per_s": len(requests) / seconds,
        "alone_sentences_per_s": sentences / alone_seconds,
    }


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    graphs = parser.add_mutually_exclusive_group(required=True)
    graphs.add_argument("--saved-model", metavar="VERSION_DIR", help="serving_default, then translate_xla")
    graphs.add_argument("--onnx", metavar="EXPORT_DIR", help="translate.onnx through OnnxTranslator")
    graphs.add_argument("--onnx-text", metavar="EXPORT_DIR", help="translate_text.onnx")
    parser.add_argument("--threads", type=int, default=8, help="client threads")
    parser.add_argument("--runtime-threads", type=int, default=2, help="the runtime's intra-op threads")
    parser.add_argument("--batch-size", type=int, default=32, help="--onnx: sentences per graph call")
    args = parser.parse_args()
    requests = json.load(sys.stdin)
    if args.saved_model:
        json.dump(_saved_model_rows(args.saved_model, requests, args), sys.stdout)
        return
    from keras_transformer_export.onnx_runtime import OnnxTranslator, TextGraph

    if args.onnx:
        translator = OnnxTranslator(args.onnx, "full", args.batch_size, args.runtime_threads)
        translate = lambda texts: translator.translate(texts)[0]  # noqa: E731
    else:
        graph = TextGraph(args.onnx_text, args.runtime_threads)
        translate = lambda texts: graph(texts)[0]  # noqa: E731
    json.dump(run_load(translate, requests, args.threads), sys.stdout)


def _saved_model_rows(version_dir, requests, args):
    """`serving_default`'s report, then `translate_xla`'s (where the version has it) after its
    warmup records, in one `ServingSession` (TF Serving's session path)."""
    import harness

    harness.tensorflow()  # without its C++ start-up lines
    from keras_transformer_export.tf_serving import ServingSession, read_warmup_requests

    session = ServingSession(version_dir, intra_op_threads=args.runtime_threads)

    def signature(name):
        def translate(texts):
            out = session.run(name, text=np.array(texts, dtype=object))["translation"]
            return [t.decode("utf-8") for t in out]

        return translate

    rows = {"saved_model (session path)": run_load(signature("serving_default"), requests, args.threads)}
    if "translate_xla" in session.signatures:
        for request in read_warmup_requests(version_dir):  # as TF Serving does at load
            session.predict(request)
        rows["saved_model_xla (session path, XLA on)"] = run_load(
            signature("translate_xla"), requests, args.threads
        )
    session.close()
    return rows


if __name__ == "__main__":
    main()

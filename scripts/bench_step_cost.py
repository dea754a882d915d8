"""What a decoding step costs at batch 1, split: the decoder alone against the whole search.

On an ONNX export directory (`export --format onnx`, any kernels), for `--limit` sentences of
`--split`, one at a time (batch 1, beam of the export), in this process without TensorFlow:

| row | what runs |
|---|---|
| translate.onnx | the whole beam search, as tf2onnx converts it (then `graph_rewrites`) |
| translate_lean.onnx | the same search written as ONNX nodes (`keras_transformer_export.lean_search`) |
| decoder alone | `encoder.onnx`, then `decoder_step.onnx` in a `Loop` (see below) |
| CTranslate2 (`--ct2`) | its own search on the same sentences (its own stopping rule) |

"Decoder alone": `encoder.onnx` once (all sentences first, then the loops), then
`decoder_step.onnx`'s nodes in an ONNX `Loop` whose next
tokens are an `ArgMax` (beam rows, growing cache), run for as many steps as the beam search ran for
that sentence: no search at all, the floor any search graph stands on.

The number of steps the beam search runs per sentence is counted by the NumPy driver
(`SplitBeamSearch`, the same stopping rule). Each row runs all sentences back to back, one row
after the other (a session's idle threads would slow the next one), `--rounds` times; the
medians are printed and written to `--json`. ms per step = ms per sentence / steps per sentence.
With `--ct2`, each row's speed against CTranslate2 is the median over rounds of the ratio
within a round (the machine's speed can change between rounds).

    python scripts/bench_step_cost.py EXPORT_DIR --data-dir ../shared/data/multi30k \\
        [--split val] [--limit 60] [--rounds 5] [--ct2 CT2_DIR] [--json results/step_cost.json]
"""

import json
import os
import statistics
import time

import harness
import numpy as np
import onnx
from onnx import helper

from keras_transformer_export.onnx_runtime import OnnxTranslator, SplitBeamSearch, _Search, make_session


def decoder_loop(export_dir):
    """`decoder_step.onnx` in a `Loop` whose tokens are the previous step's `ArgMax`: inputs the
    trip count `steps`, `token_ids`, `past_*` and the encoder's outputs."""
    decoder = onnx.load(os.path.join(export_dir, "decoder_step.onnx"))
    graph = decoder.graph
    values = {v.name: v for v in [*graph.input, *graph.output]}
    past = [v.name for v in graph.input if v.name.startswith("past_")]
    present = [name.replace("past_", "present_") for name in past]
    outer = [v.name for v in graph.input if v.name not in past and v.name != "token_ids"]
    nodes = list(graph.node) + [
        helper.make_node("ArgMax", ["log_probs"], ["best"], axis=-1, keepdims=0),
        helper.make_node("Cast", ["best"], ["next_ids"], to=onnx.TensorProto.INT32),
        helper.make_node("Identity", ["condition"], ["condition_out"]),
    ]
    scalar = onnx.helper.make_tensor_value_info
    body = helper.make_graph(
        nodes,
        "step",
        [scalar("iteration", onnx.TensorProto.INT64, []), scalar("condition", onnx.TensorProto.BOOL, [])]
        + [values["token_ids"]]
        + [values[name] for name in past],
        [scalar("condition_out", onnx.TensorProto.BOOL, []), scalar("next_ids", onnx.TensorProto.INT32, None)]
        + [values[name] for name in present],
        list(graph.initializer),
    )
    loop = helper.make_node(
        "Loop", ["steps", "go", "token_ids", *past], ["last", *[f"final_{n}" for n in past]], body=body
    )
    main = helper.make_graph(
        [loop],
        "decoder_alone",
        [scalar("steps", onnx.TensorProto.INT64, []), scalar("go", onnx.TensorProto.BOOL, [])]
        + [values["token_ids"]]
        + [values[name] for name in past + outer],
        [scalar("last", onnx.TensorProto.INT32, None)]
        + [scalar(f"final_{n}", onnx.TensorProto.FLOAT, None) for n in past],
    )
    model = helper.make_model(main, opset_imports=list(decoder.opset_import))
    model.ir_version = decoder.ir_version
    return model, past, outer


def search_steps(export_dir, sources):
    """Decoding steps the beam search runs for each source (`SplitBeamSearch`, one at a time)."""
    search, counted = SplitBeamSearch(export_dir, threads=1), []
    step = _Search.step

    def counting(self, *args):
        counted[-1] += 1
        return step(self, *args)

    _Search.step = counting
    try:
        for source_ids in sources:
            counted.append(0)
            search(source_ids)
    finally:
        _Search.step = step
    return counted


def main():
    parser = harness.parser(__doc__, "step_cost")
    parser.add_argument("export_dir")
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--split", default="val")
    parser.add_argument("--source-lang", default="en")
    parser.add_argument("--limit", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ct2", metavar="CT2_DIR", help="also CTranslate2's own search (same model)")
    parser.add_argument("--ct2-threads", type=int, default=1, help="its fastest setting at batch 1 here")
    args = parser.parse_args()
    with open(os.path.join(args.data_dir, f"{args.split}.{args.source_lang}"), encoding="utf-8") as handle:
        texts = [line.rstrip("\n") for line in handle][: args.limit]
    translator = OnnxTranslator(args.export_dir, "full", 1, args.threads)
    sources = [translator.encode([text]) for text in texts]
    steps = search_steps(args.export_dir, sources)
    config = translator.config
    beam = translator.beam_size
    heads = config["num_heads"]
    depth = config["d_model"] // heads

    sessions = {
        name: make_session(os.path.join(args.export_dir, f"{name}.onnx"), args.threads)
        for name in ("translate", "translate_lean", "encoder")
    }
    loop_model, past, outer = decoder_loop(args.export_dir)
    sessions["decoder alone"] = make_session(loop_model, args.threads)

    def run_search(name):
        for source_ids in sources:
            sessions[name].run(["nbest_ids"], {"source_ids": source_ids})

    def run_decoder():
        """Its seconds: the encoder for every sentence first, then the decoder loops (two sessions
        called in turn would slow each other, their idle threads spinning; one graph does not pay
        that), with a pause between the two that is not timed."""
        encoder = sessions["encoder"]
        names = [o.name for o in encoder.get_outputs()]
        tick = time.perf_counter()
        encoded = [dict(zip(names, encoder.run(None, {"source_ids": s}))) for s in sources]
        took = time.perf_counter() - tick
        time.sleep(0.5)  # the encoder's threads stop spinning
        tick = time.perf_counter()
        for outputs, count in zip(encoded, steps):
            feed = {
                "steps": np.array(count, np.int64),
                "go": np.array(True),
                "token_ids": np.full((beam,), config["bos_id"], np.int32),
                **{name: np.zeros((beam, heads, 0, depth), np.float32) for name in past},
                **{name: outputs[name] for name in outer},
            }
            sessions["decoder alone"].run(["last"], feed)
        return took + time.perf_counter() - tick

    rows = {
        "translate.onnx": lambda: run_search("translate"),
        "translate_lean.onnx": lambda: run_search("translate_lean"),
        "decoder alone (encoder + decoder_step in a Loop, ArgMax)": run_decoder,
    }
    if args.ct2:  # its own search and stopping rule, in a process of its own (in this one, beside
        # the ONNX Runtime sessions, it took 8.8 ms a sentence against 5.5-5.7 alone)
        pieces = [translator.processor.encode(text, out_type=str) for text in texts]
        worker = _ct2_worker(args.ct2, args.ct2_threads, pieces, beam, translator.options.length_penalty)
        rows[f"CTranslate2's own search, {args.ct2_threads} thread(s)"] = worker
    seconds = {name: [] for name in rows}
    for _ in range(args.rounds):
        for name, run in rows.items():
            time.sleep(0.5)  # the previous session's idle threads stop spinning
            tick = time.perf_counter()
            took = run()  # the seconds it timed itself (a worker process, two phases), or None
            seconds[name].append(took if took is not None else time.perf_counter() - tick)
    per_step = sum(steps) / len(steps)
    ct2 = next((values for name, values in seconds.items() if name.startswith("CTranslate2")), None)
    table, report_rows = [], {}
    for name, values in seconds.items():
        ms = 1000 * statistics.median(values) / len(sources)
        step_ms = None if name.startswith("CTranslate2") else ms / per_step  # its steps are its own
        # Against CTranslate2 within each round (the rows of a round run back to back: closer to
        # side by side than two medians when the machine's speed changes between rounds).
        ratio = None if ct2 is None else statistics.median(c / v for c, v in zip(ct2, values))
        report_rows[name] = {
            "ms_per_sentence": ms,
            "ms_per_step": step_ms,
            "ms_per_sentence_rounds": [1000 * v / len(sources) for v in values],
            "speed_vs_ctranslate2_per_round_median": ratio,
        }
        table.append([name, f"{ms:.2f}", "" if step_ms is None else f"{step_ms:.3f}"])
        if ct2 is not None:
            table[-1].append(f"{ratio:.3f}x")
    print(
        f"\n{len(sources)} {args.split} sentences at batch 1, {per_step:.1f} search steps each, "
        f"{args.threads} threads, median of {args.rounds} rounds:\n"
    )
    columns = ["graph", "ms per sentence", "ms per step"]
    harness.print_table(columns + (["speed vs CTranslate2 (median of rounds)"] if ct2 else []), table)
    with open(os.path.join(args.export_dir, "export.json"), encoding="utf-8") as handle:
        kernels = json.load(handle).get("kernels")
    harness.write_report(
        args.json,
        export_dir=args.export_dir,
        kernels=kernels,
        split=args.split,
        sentences=len(sources),
        steps_per_sentence=per_step,
        threads=args.threads,
        rounds=args.rounds,
        rows=report_rows,
    )


def _ct2_serve(ct2_dir, threads, pieces, beam, alpha, connection):
    """CTranslate2's own search over `pieces` (one sentence per call) each time it is asked: its seconds."""
    import ctranslate2

    translator = ctranslate2.Translator(ct2_dir, device="cpu", intra_threads=threads)
    translator.translate_batch(pieces[:2], beam_size=beam, length_penalty=alpha)  # loaded and warm
    while True:
        try:
            connection.recv()
        except EOFError:  # the benchmark is done
            return
        tick = time.perf_counter()
        for tokens in pieces:
            translator.translate_batch([tokens], beam_size=beam, length_penalty=alpha)
        connection.send(time.perf_counter() - tick)


def _ct2_worker(ct2_dir, threads, pieces, beam, alpha):
    """`run() -> seconds` of `_ct2_serve` in a process of its own."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(
        target=_ct2_serve, args=(ct2_dir, threads, pieces, beam, alpha, theirs), daemon=True
    )
    process.start()

    def run():
        ours.send(True)
        return ours.recv()

    return run


if __name__ == "__main__":
    main()

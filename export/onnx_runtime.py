"""Translating with the exported ONNX graphs in ONNX Runtime, without TensorFlow.

    from keras_transformer_export.onnx_runtime import OnnxTranslator
    translator = OnnxTranslator("exports/demo-onnx")              # translate.onnx (Loop inside)
    translator = OnnxTranslator("exports/demo-onnx", mode="split")  # encoder + decoder_step
    texts, scores = translator.translate(["A dog runs."])

Only `numpy`, `onnxruntime` and `sentencepiece` are imported (and the
dependency-free `keras_transformer.decoding.policy`, without the rest of the
library). Text is
tokenized with the export's `tokenizer.model` through `sentencepiece` (the
library tf-text wraps, so the ids are the same), truncated to the model's
`max_length` (EOS kept last) and batched by length.

Limits of the ONNX graphs (not of the SavedModel): `translate.onnx` and
`translate_text.onnx` need a batch of at least one sentence (tf2onnx's
`Reshape`s read a 0 as "keep this dimension"; the classes here return empty
results for an empty batch themselves), and ONNX Runtime's string tensors end
at the first NUL character ("a\x00b" is translated as "a").

`SplitBeamSearch` is the NumPy beam search that drives `encoder.onnx` and
`decoder_step.onnx`: the same algorithm, in the same float32 arithmetic, as
`keras_transformer.decoding.search.beam_search` (the rules of
`keras_transformer.decoding.policy`: length penalty, output limits, ids never
output, stopping rule; a pool of finished hypotheses and the same
tie-breaking), so it returns the same tokens.
"""

import importlib.util
import json
import os
import sys

import numpy as np

from keras_transformer_export.cache_names import cross_names, past_names, present_names


def _decoding_policy():
    """`keras_transformer.decoding.policy`, the search's rules, without running `keras_transformer`'s
    `__init__` (it imports Keras, and this module runs where only NumPy and ONNX Runtime are).
    The policy module imports nothing; it is registered under its name, so a later `import
    keras_transformer` uses the same module."""
    name = "keras_transformer.decoding.policy"
    if name not in sys.modules:
        package = importlib.util.find_spec("keras_transformer").submodule_search_locations[0]
        spec = importlib.util.spec_from_file_location(name, os.path.join(package, "decoding", "policy.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


policy = _decoding_policy()
NEG_INF = np.float32(policy.NEG_INF)
UNK_ID = 1  # kept by detokenization (keras_transformer.data.tokenizer)


def read_metadata(export_dir):
    """The export's `export.json`: versions, model config, decoding settings, graphs."""
    with open(os.path.join(export_dir, "export.json"), encoding="utf-8") as handle:
        return json.load(handle)


def make_session(path, threads=None):
    """An `onnxruntime.InferenceSession` for `path`, with onnxruntime-extensions when it needs them.

    Note: in a process that has imported TensorFlow, creating a session that
    uses the extensions' SentencePiece ops crashed (SIGSEGV) with
    onnxruntime-extensions 0.15.2 and TensorFlow 2.21 (two copies of
    SentencePiece/protobuf); run text graphs in a process without TensorFlow.
    """
    import onnxruntime

    options = onnxruntime.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    with open(path, "rb") as handle:
        model_bytes = handle.read()
    if b"ai.onnx.contrib" in model_bytes:
        import onnxruntime_extensions

        options.register_custom_ops_library(onnxruntime_extensions.get_library_path())
    return onnxruntime.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])


class SplitBeamSearch:
    """Beam search over `encoder.onnx` + `decoder_step.onnx` (see the module docstring).

    Args:
        export_dir: the directory `export_onnx` wrote.
        threads: ONNX Runtime intra-op threads (default: all cores).
    """

    def __init__(self, export_dir, threads=None, metadata=None):
        metadata = metadata or read_metadata(export_dir)
        self.config = metadata["model"]
        decoding = metadata["decoding"]
        self.beam_size, self.alpha = decoding["beam_size"], np.float32(decoding["length_penalty"])
        self.max_extra_length = decoding["max_extra_length"]
        self.num_layers = self.config["num_decoder_layers"] or self.config["num_layers"]
        self.encoder = make_session(os.path.join(export_dir, "encoder.onnx"), threads)
        self.decoder = make_session(os.path.join(export_dir, "decoder_step.onnx"), threads)

    def penalty(self, length):
        """`policy.length_penalty` in float32."""
        return policy.length_penalty(np.asarray(length, np.float32), self.alpha)

    def __call__(self, source_ids):
        """Source ids int32 `(batch, len_src)` -> `(target_ids (batch, max_len), scores (batch,))`.

        As the graph search: the self-attention caches grow by one position per
        step and are reordered with one gather each; a sentence whose search is
        final leaves the batch (its rows are dropped from every array).
        """
        source_ids = np.asarray(source_ids, np.int32)
        if source_ids.shape[1] == 0:  # an empty batch, or no columns: one padding column
            source_ids = np.zeros((source_ids.shape[0], 1), np.int32)
        config, beam = self.config, self.beam_size
        batch, source_length = source_ids.shape
        pad, eos = config["pad_id"], config["eos_id"]
        lengths = np.sum(source_ids != pad, axis=1).astype(np.int32)
        limits = policy.output_limits(lengths, config["max_length"], np, self.max_extra_length)
        max_len = int(policy.output_limits(source_length, config["max_length"], np, self.max_extra_length))
        results = np.full((batch, max_len), pad, np.int32), np.full((batch,), NEG_INF, np.float32)
        if batch == 0:
            return results

        encoded = dict(
            zip(
                [o.name for o in self.encoder.get_outputs()],
                self.encoder.run(None, {"source_ids": source_ids}),
            )
        )
        n, heads, depth = self.num_layers, config["num_heads"], config["d_model"] // config["num_heads"]
        per_sentence = {name: encoded[name] for name in ["memory_mask", *cross_names(n)]}
        past = {name: np.zeros((batch * beam, heads, 0, depth), np.float32) for name in past_names(n)}

        sentences = np.arange(batch)  # input index of each sentence still in the loop
        alive = np.full((batch, beam, max_len), pad, np.int32)
        alive_log_probs = np.tile(np.array([0.0] + [NEG_INF] * (beam - 1), np.float32), (batch, 1))
        last = np.full((batch * beam,), config["bos_id"], np.int32)
        finished = alive.copy()
        finished_scores = np.full((batch, beam), NEG_INF, np.float32)
        output_names = [o.name for o in self.decoder.get_outputs()]
        for step in range(max_len):
            rows = np.arange(len(sentences))[:, None]
            outputs = dict(
                zip(output_names, self.decoder.run(None, {"token_ids": last, **per_sentence, **past}))
            )
            log_probs = outputs["log_probs"].reshape(len(sentences), beam, -1)
            if step == 0:  # the vocabulary's masks, once
                vocab = log_probs.shape[-1]
                ids = np.arange(vocab)
                never = np.isin(ids, [config[name] for name in policy.NEVER_OUTPUT])
            is_last = (step >= limits - 1)[:, None, None]
            log_probs = np.where(
                np.logical_or(never, np.logical_and(is_last, ids != eos)), NEG_INF, log_probs
            )
            candidates = (alive_log_probs[:, :, None] + log_probs).reshape(len(sentences), -1)
            top_index = _top_k(candidates, beam)
            top_log_probs = np.take_along_axis(candidates, top_index, axis=1)
            origin, tokens = top_index // vocab, (top_index % vocab).astype(np.int32)
            alive = np.take_along_axis(alive, origin[:, :, None], axis=1)
            alive[:, :, step] = tokens
            is_eos = tokens == eos

            eos_log_probs = np.where(is_eos, top_log_probs, NEG_INF).astype(np.float32)
            pool_scores = np.concatenate([finished_scores, eos_log_probs / self.penalty(step + 1)], axis=1)
            pool = np.concatenate([finished, alive], axis=1)
            keep = _top_k(pool_scores, beam)
            finished_scores = np.take_along_axis(pool_scores, keep, axis=1)
            finished = pool[rows, keep]
            alive_log_probs = np.where(is_eos, NEG_INF, top_log_probs).astype(np.float32)
            done = policy.search_is_final(
                step + 1, limits.astype(np.float32), alive_log_probs, finished_scores, self.alpha, np
            )
            results[0][sentences[done]] = finished[done, 0]
            results[1][sentences[done]] = finished_scores[done, 0]
            staying = np.flatnonzero(~done)
            flat_origin = (rows * beam + origin)[staying].reshape(-1)
            for name, present in zip(past_names(n), present_names(n)):
                past[name] = outputs[present][flat_origin]  # one gather: beam origins of the staying
            if not len(staying):
                return results
            if done.any():
                per_sentence = {name: value[staying] for name, value in per_sentence.items()}
                sentences, limits = sentences[staying], limits[staying]
                alive, alive_log_probs = alive[staying], alive_log_probs[staying]
                finished, finished_scores = finished[staying], finished_scores[staying]
            last = tokens[staying].reshape(-1)
        results[0][sentences] = finished[:, 0]
        results[1][sentences] = finished_scores[:, 0]
        return results


def _top_k(values, k):
    """Indices of the k largest per row, largest first, ties to the lower index (as `tf.math.top_k`)."""
    return np.argsort(-values, axis=1, kind="stable")[:, :k]


class FullGraphSearch:
    """`translate.onnx`: the whole beam search as one ONNX `Loop`."""

    def __init__(self, export_dir, threads=None):
        self.session = make_session(os.path.join(export_dir, "translate.onnx"), threads)
        self.names = [o.name for o in self.session.get_outputs()]

    def __call__(self, source_ids):
        source_ids = np.asarray(source_ids, np.int32)
        if source_ids.shape[0] == 0:  # the graph's reshapes need a batch >= 1 (module docstring)
            return np.zeros((0, 1), np.int32), np.zeros((0,), np.float32)
        outputs = dict(zip(self.names, self.session.run(None, {"source_ids": source_ids})))
        return outputs["target_ids"], outputs["scores"]


class TextGraph:
    """`translate_text.onnx`: strings in, strings out, tokenization inside (onnxruntime-extensions)."""

    def __init__(self, export_dir, threads=None):
        self.session = make_session(os.path.join(export_dir, "translate_text.onnx"), threads)
        self.names = [o.name for o in self.session.get_outputs()]

    def __call__(self, sentences):
        # ONNX Runtime's Python binding takes `str` (it would turn `bytes` into "b'...'"): bytes are
        # decoded here, invalid UTF-8 replaced by U+FFFD as the SavedModel and the CLI do. And a
        # string reaches the graph cut at its first NUL, which the tokenizer reads as a space
        # (`Tokenizer.tokenize`): the replacement is made here, before the cut.
        sentences = [s.decode("utf-8", errors="replace") if isinstance(s, bytes) else s for s in sentences]
        sentences = [s.replace("\x00", " ") for s in sentences]
        if not sentences:
            return [], np.zeros((0,), np.float32)
        outputs = dict(zip(self.names, self.session.run(None, {"text": np.array(sentences, dtype=object)})))
        return [str(t) for t in outputs["translation"]], outputs["score"]


class OnnxTranslator:
    """Text in, text out with ONNX Runtime (see the module docstring).

    Args:
        export_dir: the directory `export_onnx` wrote.
        mode: `"full"` (`translate.onnx`), `"split"` (`encoder.onnx` +
            `decoder_step.onnx` with `SplitBeamSearch`), or `"text"`
            (`translate_text.onnx`; needs onnxruntime-extensions, and a
            process without TensorFlow: see `make_session`).
        batch_size: sentences per call.
        threads: ONNX Runtime intra-op threads.
    """

    MODES = ("full", "split", "text")

    def __init__(self, export_dir, mode="full", batch_size=64, threads=None):
        import sentencepiece

        if mode not in self.MODES:
            raise ValueError(f"mode must be one of {self.MODES}; got {mode!r}.")
        metadata = read_metadata(export_dir)
        self.config = metadata["model"]
        self.processor = sentencepiece.SentencePieceProcessor(
            model_file=os.path.join(export_dir, "tokenizer.model")
        )
        self.mode = mode
        if mode == "split":
            self.search = SplitBeamSearch(export_dir, threads, metadata)
        else:
            self.search = {"full": FullGraphSearch, "text": TextGraph}[mode](export_dir, threads)
        self.batch_size = batch_size

    def encode(self, sentences):
        """Strings -> source ids `(batch, len_src)`: pieces truncated to max_length - 1, EOS, padding."""
        config = self.config
        pieces = [
            ids[: config["max_length"] - 1] + [config["eos_id"]]
            for ids in self.processor.encode(list(sentences))
        ]
        source_ids = np.full((len(pieces), max(map(len, pieces), default=1)), config["pad_id"], np.int32)
        for row, ids in enumerate(pieces):
            source_ids[row, : len(ids)] = ids
        return source_ids

    def decode(self, target_ids):
        """EOS-terminated ids `(batch, max_len)` -> strings (special ids dropped, as `Tokenizer.decode`)."""
        config, texts = self.config, []
        for row in np.asarray(target_ids):
            row = row.tolist()
            row = row[: row.index(config["eos_id"])] if config["eos_id"] in row else row
            texts.append(self.processor.decode([i for i in row if i > config["eos_id"] or i == UNK_ID]))
        return texts

    def translate(self, sentences):
        """`(texts, scores)` for a list of strings, in input order."""
        sentences = list(sentences)
        texts, scores = [""] * len(sentences), np.zeros(len(sentences), np.float32)
        lengths = [len(ids) for ids in self.processor.encode(sentences)]
        order = np.argsort(lengths, kind="stable")
        for start in range(0, len(order), self.batch_size):
            batch = [sentences[i] for i in order[start : start + self.batch_size]]
            if self.mode == "text":
                batch_texts, batch_scores = self.search(batch)
            else:
                ids, batch_scores = self.search(self.encode(batch))
                batch_texts = self.decode(ids)
            for index, text, score in zip(order[start : start + self.batch_size], batch_texts, batch_scores):
                texts[index], scores[index] = text, score
        return texts, scores


def main(argv=None):
    """`python -m keras_transformer_export.onnx_runtime DIR [--mode full|split|text]`: stdin to stdout."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        prog="python -m keras_transformer_export.onnx_runtime",
        description=main.__doc__.split(":", 1)[1].strip(),
    )
    parser.add_argument("export_dir")
    parser.add_argument("--mode", choices=OnnxTranslator.MODES, default="full")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--scores", action="store_true", help="append a tab and the score")
    args = parser.parse_args(argv)
    lines = [raw.rstrip(b"\r\n").decode("utf-8", errors="replace") for raw in sys.stdin.buffer]
    texts, scores = OnnxTranslator(args.export_dir, args.mode, args.batch_size).translate(lines)
    for text, score in zip(texts, scores):
        sys.stdout.write(f"{text}\t{score:.4f}\n" if args.scores else f"{text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

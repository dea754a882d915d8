"""Translating with the exported ONNX graphs in ONNX Runtime, without TensorFlow.

    from keras_transformer_export.onnx_runtime import OnnxTranslator
    translator = OnnxTranslator("exports/demo-onnx")              # translate.onnx (Loop inside)
    translator = OnnxTranslator("exports/demo-onnx", mode="split")  # encoder + decoder_step
    translator = OnnxTranslator("exports/demo-onnx", mode="lean")   # translate_lean.onnx
    texts, scores = translator.translate(["A dog runs."])

Only `numpy`, `onnxruntime` and `sentencepiece` are imported (and the
dependency-free `keras_transformer.decoding.policy`, without the rest of the
library). Text is
tokenized with the export's `tokenizer.model` through `sentencepiece` (the
library tf-text wraps, so the ids are the same), truncated to the model's
`max_length` (EOS kept last) and batched by length.

A limit of the ONNX text graph (not of the SavedModel): ONNX Runtime's string
tensors end at the first NUL character ("a\x00b" would be translated as "a";
`TextGraph` replaces NUL by a space first, as the tokenizer reads it).

`SplitBeamSearch` is the NumPy search that drives `encoder.onnx` and
`decoder_step.onnx`: the same algorithms (beam search, sampling), in the same
float32 arithmetic, as `keras_transformer.decoding.request.decode`, with the
same rules (`keras_transformer.decoding.policy`, `.controls`, `.sampling`,
loaded without Keras: length penalty, output limits, ids never output, stopping
rule, every decoding control; a pool of finished hypotheses and the same
tie-breaking), so it returns the same tokens. Every class here takes a
request's options (`DecodingOptions`) per call.
"""

import dataclasses
import importlib.util
import json
import os
import sys

import numpy as np

from keras_transformer_export.cache_names import cache_layers, cross_names, past_names, present_names
from keras_transformer_export.request_pieces import encode_each


def _decoding_module(name):
    """`keras_transformer.decoding.<name>` (the search's rules: `policy`, `controls`, `sampling`,
    `alignments`), without running `keras_transformer`'s `__init__` (it imports Keras, and this
    module runs where only NumPy and ONNX Runtime are). These modules import nothing but each
    other; each is registered under its name, so a later `import keras_transformer` uses the
    same module."""
    name = f"keras_transformer.decoding.{name}"
    if name not in sys.modules:
        package = importlib.util.find_spec("keras_transformer").submodule_search_locations[0]
        path = os.path.join(package, "decoding", name.rsplit(".", 1)[1] + ".py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


policy = _decoding_module("policy")
rules = _decoding_module("controls")
sampling = _decoding_module("sampling")
alignments_module = _decoding_module("alignments")
DecodingOptions, Hypotheses = rules.DecodingOptions, rules.Hypotheses
NEG_INF = np.float32(policy.NEG_INF)
UNK_ID = policy.UNK_ID  # kept by detokenization (keras_transformer.data.tokenizer)


def read_metadata(export_dir):
    """The export's `export.json`: versions, model config, decoding settings, graphs."""
    with open(os.path.join(export_dir, "export.json"), encoding="utf-8") as handle:
        return json.load(handle)


def make_session(path, threads=None, disabled_optimizers=()):
    """An `onnxruntime.InferenceSession` for `path` (or an `onnx.ModelProto`), with
    onnxruntime-extensions when it needs them, without ONNX Runtime's graph optimizers named in
    `disabled_optimizers`.

    Note: in a process that has imported TensorFlow, creating a session that
    uses the extensions' SentencePiece ops crashed (SIGSEGV) with
    onnxruntime-extensions 0.15.2 and TensorFlow 2.21 (two copies of
    SentencePiece/protobuf); run text graphs in a process without TensorFlow.
    """
    import onnxruntime

    options = onnxruntime.SessionOptions()
    # translate.onnx's options are inputs backed by initializers (their defaults), which ONNX
    # Runtime reports as a warning per input when the session is made: errors only.
    options.log_severity_level = 3
    if threads:
        options.intra_op_num_threads = threads
    if hasattr(path, "SerializeToString"):  # an `onnx.ModelProto` built in memory
        model_bytes = path.SerializeToString()
    else:
        with open(path, "rb") as handle:
            model_bytes = handle.read()
    if b"ai.onnx.contrib" in model_bytes:
        import onnxruntime_extensions

        options.register_custom_ops_library(onnxruntime_extensions.get_library_path())
    return onnxruntime.InferenceSession(
        model_bytes,
        options,
        providers=["CPUExecutionProvider"],
        disabled_optimizers=list(disabled_optimizers) or None,
    )


class SplitBeamSearch:
    """The searches over `encoder.onnx` + `decoder_step.onnx` (see the module docstring), with
    every decoding control of `keras_transformer.decoding.controls`.

    Args:
        export_dir: the directory `export_onnx` wrote.
        threads: ONNX Runtime intra-op threads (default: all cores).
    """

    def __init__(self, export_dir, threads=None, metadata=None):
        import sentencepiece

        metadata = metadata or read_metadata(export_dir)
        self.config = metadata["model"]
        decoding = metadata["decoding"]
        self.beam_size = decoding["beam_size"]
        self.options = export_options(metadata)
        self.num_layers = cache_layers(self.config)
        self.encoder = make_session(os.path.join(export_dir, "encoder.onnx"), threads)
        self.decoder = make_session(os.path.join(export_dir, "decoder_step.onnx"), threads)
        align_path = os.path.join(export_dir, "align.onnx")
        self.aligner = make_session(align_path, threads) if os.path.exists(align_path) else None
        processor = sentencepiece.SentencePieceProcessor(
            model_file=os.path.join(export_dir, "tokenizer.model")
        )
        pieces, count = processor.id_to_piece, processor.get_piece_size()
        self.blank = np.array(policy.blank_ids(pieces, count), bool)
        specials = [self.config[name] for name in policy.NEVER_OUTPUT]
        vocab = self.config["target_vocab_size"] or self.config["vocab_size"]
        self.never = np.array(policy.never_output_ids(pieces, count, specials, vocab), bool)
        self.output_names = [o.name for o in self.decoder.get_outputs()]

    def __call__(self, source_ids):
        """Source ids int32 `(batch, len_src)` -> the best `(target_ids (batch, max_len), scores
        (batch,))` under the export's options."""
        found = self.search(source_ids)
        return found.ids[:, 0], found.scores[:, 0]

    def search(
        self, source_ids, options=None, target_prefix=None, suppress_sequences=None, sentence_ids=None
    ):
        """`Hypotheses` `(batch, num_return, ...)` of source ids int32 `(batch, len_src)`, as
        `keras_transformer.decoding.request.decode` gives them (empty sources not searched).

        Args:
            options: a `DecodingOptions` (default: the export's).
            target_prefix: one token list per sentence; suppress_sequences: token lists.
            sentence_ids: each row's index in the request (sampling's key; default the row).
        """
        options = (options or self.options).check(self.beam_size)
        config = self.config
        source_ids = np.asarray(source_ids, np.int32)
        if source_ids.shape[1] == 0:  # an empty batch, or no columns: one padding column
            source_ids = np.zeros((source_ids.shape[0], 1), np.int32)
        batch, length = source_ids.shape
        pad, n = config["pad_id"], options.num_return
        prefix = _token_array([[]] * batch if target_prefix is None else target_prefix, pad)
        sequences = _token_array(suppress_sequences or [], pad)
        sentence_ids = np.arange(batch) if sentence_ids is None else np.asarray(sentence_ids)
        max_len = int(policy.output_limits(length, config["max_length"], np, options.max_extra_length))
        ids = np.full((batch, n, max_len), pad, np.int32)
        ids[:, :, 0] = config["eos_id"]  # an empty source's hypotheses: EOS alone, score 0
        found = Hypotheses(ids, np.zeros((batch, n), np.float32), np.zeros((batch, n), np.float32))
        if options.return_alignments:
            found = found._replace(alignments=np.full((batch, n, max_len), -1, np.int32))
        keep = np.flatnonzero(~policy.empty_sources(source_ids, self.blank, np))
        if not len(keep):
            return found
        search = _Search(self, source_ids[keep], options, prefix[keep], sequences, max_len)
        kept = search.sample(sentence_ids[keep]) if options.sampling else search.beam()
        for whole, part in zip(found[:3], kept):
            whole[keep] = part
        if options.return_alignments:
            aligned = self.aligner.run(None, {"source_ids": source_ids[keep], "target_ids": kept[0]})[0]
            found.alignments[keep] = aligned
        return found


def export_options(metadata):
    """The `DecodingOptions` an export was made with (its graphs' input defaults)."""
    decoding = dict(metadata["decoding"])
    decoding.pop("beam_size")
    return DecodingOptions(**decoding)


def _token_array(lists, pad):
    rows = rules.padded_token_lists(lists, pad)
    return np.array(rows, np.int32).reshape(len(rows), len(rows[0]) if rows else 1)


def _log_softmax(logits):
    """float32 log-softmax along the last axis, as TensorFlow's kernel computes it."""
    shifted = logits - np.max(logits, axis=-1, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


class _Search:
    """One batch of sources with content, searched over the step graphs."""

    def __init__(self, owner, source_ids, options, prefix, sequences, max_len):
        config = owner.config
        self.owner, self.config, self.options, self.max_len = owner, config, options, max_len
        self.decoder, self.output_names = owner.decoder, owner.output_names
        self.batch = len(source_ids)
        self.limits = policy.output_limits(
            np.sum(source_ids != config["pad_id"], axis=1).astype(np.int32),
            config["max_length"],
            np,
            options.max_extra_length,
        )
        self.alpha = np.float32(options.length_penalty)
        vocab = config["target_vocab_size"] or config["vocab_size"]
        ids = np.arange(vocab)
        self.is_eos = ids == config["eos_id"]
        self.never = owner.never
        sequence_lengths = np.sum(sequences != config["pad_id"], axis=1)
        suppressed = rules.single_token_bans(sequences, sequence_lengths, vocab, np)
        if options.disable_unk:
            suppressed |= ids == UNK_ID
        self.suppressed = suppressed if np.any(suppressed) else None
        self.sequences = sequences if np.any(sequence_lengths > 1) else None
        self.prefix = prefix if np.any(prefix != config["pad_id"]) else None
        self.vocab = vocab
        encoded = dict(
            zip(
                [o.name for o in owner.encoder.get_outputs()],
                owner.encoder.run(None, {"source_ids": source_ids}),
            )
        )
        self.per_sentence = {name: encoded[name] for name in ["memory_mask", *cross_names(owner.num_layers)]}

    def past(self, rows):
        config = self.config
        shape = (rows, config["num_heads"], 0, config["d_model"] // config["num_heads"])
        return {name: np.zeros(shape, np.float32) for name in past_names(self.owner.num_layers)}

    def step(self, last, per_sentence, past):
        """The decoder step's outputs by name."""
        return dict(
            zip(self.output_names, self.decoder.run(None, {"token_ids": last, **per_sentence, **past}))
        )

    def log_probs(self, outputs, history, step, limits, prefix):
        """`search._Setup.step_log_probs` in NumPy: `(sentences, beam, vocab)`."""
        options, shape = self.options, history.shape[:2] + (self.vocab,)
        pad = self.config["pad_id"]
        size = options.no_repeat_ngram_size
        if (
            options.repetition_penalty == 1.0
            and self.suppressed is None
            and not size
            and self.sequences is None
        ):
            raw = outputs["log_probs"].reshape(shape)
            unbanned = None  # the prefix's log-probabilities are `raw`'s
        else:  # CTranslate2's order: the penalty, then the controls' bans, on the logits
            logits = outputs["logits"].reshape(shape)
            if options.repetition_penalty != 1.0:
                penalty = np.float32(options.repetition_penalty)
                logits = rules.repetition_penalized(logits, history, step, penalty, pad, np)
            unbanned = logits  # what a prefix token's log-probability is taken from
            if self.suppressed is not None:
                logits = np.where(self.suppressed, np.float32(policy.NEG_INF), logits)
            if size:
                tokens, banned = rules.repeated_ngram_ends(history, step, size, np)
                logits = rules.ban(logits, tokens, banned, pad, np)
            if self.sequences is not None:
                lengths = np.sum(self.sequences != pad, axis=1)
                tokens, banned = rules.sequence_ends(history, step, self.sequences, lengths, np)
                logits = rules.ban(logits, tokens, banned, pad, np)
            raw = _log_softmax(logits)
        log_probs = policy.constrain(raw, step, limits, self.never, self.is_eos, options.min_length, np)
        if prefix is not None and np.any(step < np.sum(prefix != pad, axis=1)):
            lengths = np.sum(prefix != pad, axis=1)
            free = raw if unbanned is None else _log_softmax(unbanned)
            log_probs = rules.forced_prefix(log_probs, free, step, prefix, lengths, np)
        return log_probs.astype(np.float32)

    def penalty(self, length):
        """`policy.length_penalty` in float32."""
        return policy.length_penalty(np.asarray(length, np.float32), self.alpha)

    def beam(self):
        """The beam search: `(ids (batch, n, max_len), scores (batch, n), log_probs (batch, n))`.

        As the graph search: the self-attention caches grow by one position per
        step and are reordered with one gather each; a sentence whose search is
        final leaves the batch (its rows are dropped from every array).
        """
        config, beam, batch, max_len = self.config, self.owner.beam_size, self.batch, self.max_len
        pad, eos = config["pad_id"], config["eos_id"]
        per_sentence, past, limits, prefix = (
            self.per_sentence,
            self.past(batch * beam),
            self.limits,
            self.prefix,
        )
        results = (
            np.full((batch, beam, max_len), pad, np.int32),
            np.full((batch, beam), NEG_INF, np.float32),
            np.full((batch, beam), NEG_INF, np.float32),
        )
        sentences = np.arange(batch)  # input index of each sentence still in the loop
        alive = np.full((batch, beam, max_len), pad, np.int32)
        alive_log_probs = np.tile(np.array([0.0] + [NEG_INF] * (beam - 1), np.float32), (batch, 1))
        last = np.full((batch * beam,), config["bos_id"], np.int32)
        finished = alive.copy()
        finished_scores = np.full((batch, beam), NEG_INF, np.float32)
        finished_log_probs = finished_scores.copy()
        for step in range(max_len):
            rows = np.arange(len(sentences))[:, None]
            outputs = self.step(last, per_sentence, past)
            log_probs = self.log_probs(outputs, alive, step, limits, prefix)
            candidates = (alive_log_probs[:, :, None] + log_probs).reshape(len(sentences), -1)
            top_index = _top_k(candidates, beam)
            top_log_probs = np.take_along_axis(candidates, top_index, axis=1)
            origin, tokens = top_index // self.vocab, (top_index % self.vocab).astype(np.int32)
            alive = np.take_along_axis(alive, origin[:, :, None], axis=1)
            alive[:, :, step] = tokens
            is_eos = tokens == eos

            eos_log_probs = np.where(is_eos, top_log_probs, NEG_INF).astype(np.float32)
            pool_scores = np.concatenate([finished_scores, eos_log_probs / self.penalty(step + 1)], axis=1)
            pool_log_probs = np.concatenate([finished_log_probs, eos_log_probs], axis=1)
            pool = np.concatenate([finished, alive], axis=1)
            keep = _top_k(pool_scores, beam)
            finished_scores = np.take_along_axis(pool_scores, keep, axis=1)
            finished_log_probs = np.take_along_axis(pool_log_probs, keep, axis=1)
            finished = pool[rows, keep]
            alive_log_probs = np.where(is_eos, NEG_INF, top_log_probs).astype(np.float32)
            done = policy.search_is_final(
                step + 1,
                limits.astype(np.float32),
                alive_log_probs,
                finished_scores,
                self.alpha,
                np,
                bool(self.options.early_stopping),
            )
            for result, value in zip(results, (finished, finished_scores, finished_log_probs)):
                result[sentences[done]] = value[done]
            staying = np.flatnonzero(~done)
            flat_origin = (rows * beam + origin)[staying].reshape(-1)
            n = self.owner.num_layers
            for name, present in zip(past_names(n), present_names(n)):
                past[name] = outputs[present][flat_origin]  # one gather: beam origins of the staying
            if not len(staying):
                break
            if done.any():
                per_sentence = {name: value[staying] for name, value in per_sentence.items()}
                sentences, limits = sentences[staying], limits[staying]
                prefix = None if prefix is None else prefix[staying]
                alive, alive_log_probs = alive[staying], alive_log_probs[staying]
                finished, finished_scores = finished[staying], finished_scores[staying]
                finished_log_probs = finished_log_probs[staying]
            last = tokens[staying].reshape(-1)
        else:
            for result, value in zip(results, (finished, finished_scores, finished_log_probs)):
                result[sentences] = value
        count = self.options.num_return
        return tuple(result[:, :count] for result in results)

    def sample(self, sentence_ids):
        """`num_return` samples per sentence, token by token (`search._sample` in NumPy)."""
        config, options, max_len = self.config, self.options, self.max_len
        n, pad, eos = options.num_return, config["pad_id"], config["eos_id"]
        rows = self.batch * n
        sentence_keys, sample_keys = np.repeat(sentence_ids, n), np.tile(np.arange(n), self.batch)
        limits = np.repeat(self.limits, n)
        prefix = None if self.prefix is None else np.repeat(self.prefix, n, axis=0)
        past = self.past(rows)
        tokens = np.full((rows, max_len), pad, np.int32)
        last = np.full((rows,), config["bos_id"], np.int32)
        total = np.zeros((rows,), np.float32)
        finished = np.zeros((rows,), bool)
        for step in range(max_len):
            if finished.all():
                break
            outputs = self.step(last, self.per_sentence, past)
            log_probs = self.log_probs(outputs, tokens[:, None], step, limits, prefix)[:, 0]
            keys = sampling.row_keys(options.seed, sentence_keys, sample_keys, step, np)
            chosen = sampling.sample(
                log_probs, keys, options.sampling_topk, np.float32(options.sampling_topp),
                np.float32(options.sampling_temperature), np,
            )  # fmt: skip
            chosen_log_probs = np.take_along_axis(log_probs, chosen[:, None], axis=-1)[:, 0]
            chosen = np.where(finished, pad, chosen).astype(np.int32)
            total = (total + np.where(finished, np.float32(0.0), chosen_log_probs)).astype(np.float32)
            tokens[:, step] = chosen
            finished |= chosen == eos
            n_layers = self.owner.num_layers
            past = {
                name: outputs[present] for name, present in zip(past_names(n_layers), present_names(n_layers))
            }
            last = chosen
        lengths = np.sum(tokens != pad, axis=1).astype(np.float32)
        scores = (total / self.penalty(lengths)).astype(np.float32)
        shape = (self.batch, n)
        return tokens.reshape(*shape, max_len), scores.reshape(shape), total.reshape(shape)


def _top_k(values, k):
    """Indices of the k largest per row, largest first, ties to the lower index (as `tf.math.top_k`)."""
    return np.argsort(-values, axis=1, kind="stable")[:, :k]


class FullGraphSearch:
    """`translate.onnx`: the whole search inside one graph; a request's options are its inputs."""

    def __init__(self, export_dir, threads=None, metadata=None):
        metadata = metadata or read_metadata(export_dir)
        self.beam_size, self.options = metadata["decoding"]["beam_size"], export_options(metadata)
        self.session = make_session(os.path.join(export_dir, "translate.onnx"), threads)
        self.names = [o.name for o in self.session.get_outputs()]

    def __call__(self, source_ids):
        """The best `(target_ids (batch, max_len), scores (batch,))` under the export's options."""
        found = self.search(source_ids)
        return found.ids[:, 0], found.scores[:, 0]

    def search(
        self, source_ids, options=None, target_prefix=None, suppress_sequences=None, sentence_ids=None
    ):
        """`Hypotheses` (as `SplitBeamSearch.search`): only the options that differ from the
        export's are sent, the graph's initializers give the others."""
        outputs = dict(
            zip(
                self.names,
                self.session.run(
                    None,
                    request_feed(
                        source_ids, options, self.options, target_prefix, suppress_sequences, sentence_ids
                    ),
                ),
            )
        )
        asked = (options or self.options).return_alignments
        return Hypotheses(
            outputs["nbest_ids"], outputs["nbest_scores"], outputs["nbest_log_probs"],
            outputs["alignments"] if asked else None,
        )  # fmt: skip


# The file stem of the hand-built plain beam search (`keras_transformer_export.lean_search`), and
# its option inputs (defaults: the export's options) with their dtypes.
LEAN_GRAPH = "translate_lean"
LEAN_OPTIONS = {
    name: np.dtype(rules.OPTION_DTYPES[name]).type
    for name in ("length_penalty", "max_extra_length", "min_length", "early_stopping")
}
CONTROLS_OFF = DecodingOptions()  # every option at its default: each control off


class LeanGraphSearch:
    """`translate_lean.onnx` (`keras_transformer_export.lean_search`): the beam search of a request
    without controls as ~65 ONNX nodes a step (`translate.onnx` has ~200), the same tokens. A
    request that switches a control on (target prefix, banned words or sequences, `disable_unk`,
    n-gram or repetition limits), samples or asks for alignments is searched by `translate.onnx`
    (`FullGraphSearch`, loaded beside it)."""

    def __init__(self, export_dir, threads=None, metadata=None):
        metadata = metadata or read_metadata(export_dir)
        path = os.path.join(export_dir, f"{LEAN_GRAPH}.onnx")
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"{path} does not exist: the export predates {LEAN_GRAPH}.onnx; export the model again, "
                "or use mode='full'."
            )
        self.beam_size, self.options = metadata["decoding"]["beam_size"], export_options(metadata)
        self.session = make_session(path, threads)
        self.names = [o.name for o in self.session.get_outputs()]
        self.full = FullGraphSearch(export_dir, threads, metadata)

    def __call__(self, source_ids):
        """The best `(target_ids (batch, max_len), scores (batch,))` under the export's options."""
        found = self.search(source_ids)
        return found.ids[:, 0], found.scores[:, 0]

    @staticmethod
    def plain(options, target_prefix=None, suppress_sequences=None):
        """Whether a request is one `translate_lean.onnx` searches: every control off, no sampling,
        no alignments (its length penalty, output limit, minimum length, early stopping and
        `num_return` may be any)."""
        off = CONTROLS_OFF
        return (
            not options.sampling
            and all(
                getattr(options, name) == getattr(off, name)
                for name in ("disable_unk", "no_repeat_ngram_size", "repetition_penalty", "return_alignments")
            )
            and not any(len(p) for p in (target_prefix if target_prefix is not None else []))
            and not any(len(s) for s in (suppress_sequences if suppress_sequences is not None else []))
        )

    def search(
        self, source_ids, options=None, target_prefix=None, suppress_sequences=None, sentence_ids=None
    ):
        """`Hypotheses` (as `SplitBeamSearch.search`)."""
        request = options or self.options
        if not self.plain(request, target_prefix, suppress_sequences):
            return self.full.search(source_ids, options, target_prefix, suppress_sequences, sentence_ids)
        source_ids = np.asarray(source_ids, np.int32)
        if source_ids.shape[1] == 0:  # an empty batch, or no columns: one padding column
            source_ids = np.zeros((source_ids.shape[0], 1), np.int32)
        feed = {"source_ids": source_ids}
        for name, dtype in LEAN_OPTIONS.items():  # only what differs from the export's
            if getattr(request, name) != getattr(self.options, name):
                feed[name] = np.array(getattr(request, name), dtype)
        outputs = dict(zip(self.names, self.session.run(None, feed)))
        n = request.num_return
        return Hypotheses(
            outputs["nbest_ids"][:, :n], outputs["nbest_scores"][:, :n], outputs["nbest_log_probs"][:, :n]
        )


def request_feed(
    source_ids, options, defaults, target_prefix=None, suppress_sequences=None, sentence_ids=None
):
    """The inputs of `translate.onnx` (or `translate_text.onnx`, with `text` for `source_ids`) for a
    request: the options that differ from `defaults` (the export's), and the prefix, banned
    sequences and sentence indices where given (token lists)."""
    feed = {} if source_ids is None else {"source_ids": np.asarray(source_ids, np.int32)}
    if options is not None:
        for name, value in dataclasses.asdict(options).items():
            if value != getattr(defaults, name):
                feed[name] = np.array(value, rules.OPTION_DTYPES[name])
    pad = 0
    if target_prefix is not None:
        feed["target_prefix"] = _token_array(target_prefix, pad)
    if suppress_sequences:
        feed["suppress_sequences"] = _token_array(suppress_sequences, pad)
    if sentence_ids is not None:
        feed["sentence_ids"] = np.asarray(sentence_ids, np.int32)
    return feed


class TextGraph:
    """`translate_text.onnx`: strings in, strings out, tokenization inside (onnxruntime-extensions);
    the options as `translate.onnx`'s (the prefix and banned sequences as ids)."""

    def __init__(self, export_dir, threads=None, metadata=None):
        metadata = metadata or read_metadata(export_dir)
        self.options = export_options(metadata)
        self.session = make_session(os.path.join(export_dir, "translate_text.onnx"), threads)
        self.names = [o.name for o in self.session.get_outputs()]

    def __call__(self, sentences):
        """`(translations, scores)`: the best of each sentence under the export's options."""
        outputs = self.run(sentences)
        if outputs is None:
            return [], np.zeros((0,), np.float32)
        return [str(t) for t in outputs["translation"]], outputs["score"]

    def run(self, sentences, options=None, target_prefix=None, suppress_sequences=None, sentence_ids=None):
        """The graph's outputs by name (None for no sentences)."""
        # ONNX Runtime's Python binding takes `str` (it would turn `bytes` into "b'...'"): bytes are
        # decoded here, invalid UTF-8 replaced by U+FFFD as the SavedModel and the CLI do. And a
        # string reaches the graph cut at its first NUL, which the tokenizer reads as a space
        # (`Tokenizer.tokenize`): the replacement is made here, before the cut.
        sentences = [s.decode("utf-8", errors="replace") if isinstance(s, bytes) else s for s in sentences]
        sentences = [s.replace("\x00", " ") for s in sentences]
        if not sentences:
            return None
        feed = request_feed(None, options, self.options, target_prefix, suppress_sequences, sentence_ids)
        feed["text"] = np.array(sentences, dtype=object)
        return dict(zip(self.names, self.session.run(None, feed)))


class OnnxTranslator:
    """Text in, text out with ONNX Runtime (see the module docstring), with every decoding
    control (`keras_transformer.decoding.controls`) per call.

    Args:
        export_dir: the directory `export_onnx` wrote.
        mode: `"full"` (`translate.onnx`), `"split"` (`encoder.onnx` +
            `decoder_step.onnx` with `SplitBeamSearch`), `"text"`
            (`translate_text.onnx`; needs onnxruntime-extensions, and a
            process without TensorFlow: see `make_session`), or `"lean"`
            (`translate_lean.onnx` for the requests without controls, the
            others by `translate.onnx`: `LeanGraphSearch`).
        batch_size: sentences per call.
        threads: ONNX Runtime intra-op threads.
    """

    MODES = ("full", "split", "text", "lean")

    def __init__(self, export_dir, mode="full", batch_size=64, threads=None):
        import sentencepiece

        if mode not in self.MODES:
            raise ValueError(f"mode must be one of {self.MODES}; got {mode!r}.")
        metadata = read_metadata(export_dir)
        self.config = metadata["model"]
        self.beam_size, self.options = metadata["decoding"]["beam_size"], export_options(metadata)
        self.processor = sentencepiece.SentencePieceProcessor(
            model_file=os.path.join(export_dir, "tokenizer.model")
        )
        self.mode = mode
        searches = {
            "full": FullGraphSearch,
            "split": SplitBeamSearch,
            "text": TextGraph,
            "lean": LeanGraphSearch,
        }
        self.search = searches[mode](export_dir, threads, metadata)
        self.batch_size = batch_size

    def encode(self, sentences):
        """Strings -> source ids `(batch, len_src)`: pieces truncated to max_length - 1, EOS, padding."""
        return self._source_ids(encode_each(self.processor, sentences))

    def _source_ids(self, sentence_pieces):
        """`encode` of the sentences' SentencePiece ids."""
        config = self.config
        pieces = [ids[: config["max_length"] - 1] + [config["eos_id"]] for ids in sentence_pieces]
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

    def translate(self, sentences, **options):
        """`(texts, scores)` for a list of strings, in input order: the best of each
        (`translate_hypotheses` for n-best lists, prefixes and alignments)."""
        if not options and self.mode == "text":  # the graph's own strings
            return self._translate_text(list(sentences))
        hypotheses = self.translate_hypotheses(sentences, **options)
        return [h[0].text for h in hypotheses], np.array([h[0].score for h in hypotheses], np.float32)

    def _translate_text(self, sentences):
        texts, scores = [""] * len(sentences), np.zeros(len(sentences), np.float32)
        for indices in self._batches(encode_each(self.processor, sentences)):
            batch_texts, batch_scores = self.search([sentences[i] for i in indices])
            for index, text, score in zip(indices, batch_texts, batch_scores):
                texts[index], scores[index] = text, score
        return texts, scores

    def _batches(self, sentence_pieces):
        """Index arrays of the batches, sentences sorted by their number of pieces (less padding)."""
        order = np.argsort([len(ids) for ids in sentence_pieces], kind="stable")
        return [order[start : start + self.batch_size] for start in range(0, len(order), self.batch_size)]

    def translate_hypotheses(self, sentences, target_prefix=None, suppress_sequences=None, **options):
        """A list (one per sentence) of `num_return` `Hypothesis`, as `Translator.translate_hypotheses`.

        `target_prefix`: one string (or None) per sentence; `suppress_sequences`: strings;
        `options`: `DecodingOptions` fields for this call (`ValueError` for bad ones).
        """
        options = self.options.replace(**options).check(self.beam_size)
        sentences = list(sentences)
        config = self.config
        vocab = config["target_vocab_size"] or config["vocab_size"]
        reserved = [config[name] for name in rules.RESERVED_IDS]
        if target_prefix is not None and (
            isinstance(target_prefix, str) or len(target_prefix) != len(sentences)
        ):
            raise ValueError(
                f"target_prefix must be a list with one string (or None) per sentence: {len(sentences)}."
            )
        prefixes = encode_each(
            self.processor, ["" if p is None else p for p in target_prefix or [None] * len(sentences)]
        )
        sequences = encode_each(self.processor, suppress_sequences or [])
        rules.check_token_lists("target_prefix", prefixes, vocab, reserved)
        rules.check_token_lists("suppress_sequences", sequences, vocab, reserved)
        results = [None] * len(sentences)
        sentence_pieces = encode_each(self.processor, sentences)  # once: the batches' order and ids
        for indices in self._batches(sentence_pieces):
            source_ids = self._source_ids([sentence_pieces[i] for i in indices])
            prefix = [prefixes[i] for i in indices]
            rules.check_prefix_lengths(
                list(map(len, prefix)), np.sum(source_ids != config["pad_id"], axis=1).tolist(),
                config["max_length"], options.max_extra_length, indices.tolist(),
            )  # fmt: skip
            found, best = self._search(indices, sentences, source_ids, options, prefix, sequences)
            for row, index in enumerate(indices):
                texts = self.decode(found.ids[row])
                if best is not None:
                    texts[0] = best[row]
                alignments = None
                if options.return_alignments:
                    source = self.processor.encode(sentences[index], out_type=str)[: config["max_length"] - 1]
                    piece = self.processor.id_to_piece
                    alignments = [
                        alignments_module.word_alignment(source, [piece(int(i)) for i in ids], aligned)
                        for ids, aligned in zip(found.ids[row], found.alignments[row])
                    ]
                results[index] = rules.sentence_hypotheses(
                    texts, found.scores[row], found.log_probs[row], alignments
                )
        return results

    def _search(self, indices, sentences, source_ids, options, prefix, sequences):
        """`(Hypotheses, the graph's best strings or None)` of one batch."""
        sentence_ids = indices.astype(np.int32)
        if self.mode != "text":
            return self.search.search(source_ids, options, prefix, sequences, sentence_ids), None
        outputs = self.search.run([sentences[i] for i in indices], options, prefix, sequences, sentence_ids)
        found = Hypotheses(
            outputs["nbest_ids"], outputs["nbest_scores"], outputs["nbest_log_probs"], outputs["alignments"]
        )
        return found, [str(t) for t in outputs["translation"]]


def main(argv=None):
    """`python -m keras_transformer_export.onnx_runtime DIR [--mode MODE]`: stdin to stdout."""
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

"""CTranslate2 models of a trained `Transformer`, and translation with them.

CTranslate2 (OpenNMT's C++ inference engine) runs the same architecture as
our model. `export_ctranslate2` fills its `TransformerSpec` with our weights
and writes, atomically (`keras_transformer_export.layout.atomic_directory`):

| file                     | what                                                        |
|--------------------------|-------------------------------------------------------------|
| `model.bin`              | the weights (float32, or int8 with `quantization="int8"`)   |
| `config.json`            | CTranslate2's model configuration                           |
| `shared_vocabulary.json` | the SentencePiece pieces in id order (or source/target ones) |
| `tokenizer.model`        | the run's SentencePiece model                               |
| `export.json`            | versions, the model config and the decoding settings        |

How the weights map (CTranslate2 stores linear weights `(out, in)`):
- our `(d_model, num_heads, depth)` query/key/value kernels are `(d_model,
  d_model)` matrices whose output columns are head-major, as CTranslate2
  splits them; self-attention Q, K, V are fused into one `(3 d_model,
  d_model)` linear, cross-attention K, V into one `(2 d_model, d_model)`;
- post-norm (the paper) is `pre_norm=False`; pre-norm models have a final
  norm per stack, which CTranslate2's pre-norm layout has too;
- embeddings are scaled by sqrt(d_model) on both sides (`scale_embeddings`);
- the §3.5 sinusoid table is given explicitly: ours interleaves sines and
  cosines, CTranslate2's built-in one concatenates them (a different table);
- the tied pre-softmax projection is the target embedding matrix (no bias);
  an untied one is its `Dense` kernel and bias;
- `layer_norm_epsilon` goes into `config.json`.

Decoding (`CTranslate2Translator`) follows `keras_transformer.decoding.search`:
sources end with EOS (`add_source_eos`), pad and BOS are never output
(`suppress_sequences`), nor the pieces of control characters (`_search`), and
each sentence may produce up to `source length + max_extra_length` tokens, EOS
included (sentences are batched by source length, so one `max_decoding_length`
per call is each sentence's own limit).
Two differences remain, and what is compared is said here:
- **Length penalty.** CTranslate2 ranks finished hypotheses by score /
  length^alpha; ours is GNMT's ((5 + length) / 6)^alpha. The translator asks
  for the `beam_size` best hypotheses with their log-probabilities
  (`length_penalty=0`) and ranks them by the GNMT penalty itself, so a
  hypothesis both searches find gets the same rank and score.
- **Search.** CTranslate2 refills finished beam slots from 2 x beam
  candidates and stops once `beam_size` hypotheses have finished; ours
  keeps finished slots empty and stops when no live hypothesis can beat the
  worst finished one. Both find the same best hypothesis on the sentences
  the tests translate (beam and greedy, 100 sentences), but a different
  search can in general find a different one. Greedy search (beam 1) is the
  same algorithm in both. At the length limit ours forces EOS and
  CTranslate2 stops without it: the translator rescores such hypotheses
  with EOS appended (`score_batch`), so their scores are ours too.

Quantization: `"int8"` stores int8 weights (CTranslate2 computes int8 matrix
products on CPU); gate it on BLEU measured on your data (the README's
deployment section has ours).
"""

import json
import os

import numpy as np

from keras_transformer.decoding import policy
from keras_transformer.decoding.alignments import word_alignment
from keras_transformer.decoding.controls import DecodingOptions, Hypothesis
from keras_transformer.utils.checks import UserError
from keras_transformer_export.layout import atomic_directory
from keras_transformer_export.request_pieces import encode_each

QUANTIZATIONS = ("float32", "int8")
SETTINGS_FILE = "export.json"


def _ctranslate2():
    try:
        import ctranslate2
    except ImportError:
        raise UserError(
            "CTranslate2 is not installed: pip install ctranslate2 "
            "(or the `ctranslate2` extra of keras-transformer)."
        ) from None
    return ctranslate2


def _numpy(variable):
    return np.asarray(variable.numpy() if hasattr(variable, "numpy") else variable, np.float32)


def _linear(spec, kernel, bias):
    """A Keras-layout kernel `(in, out)` (any trailing split of `out`) into a CTranslate2 LinearSpec."""
    kernel = _numpy(kernel)
    spec.weight = np.ascontiguousarray(kernel.reshape(kernel.shape[0], -1).T)
    if bias is not None:
        spec.bias = _numpy(bias).reshape(-1)


def _norm(spec, layer_norm):
    spec.gamma, spec.beta = _numpy(layer_norm.gamma), _numpy(layer_norm.beta)


def _attention(spec, attention, self_attention):
    """Our `MultiHeadAttention` into CTranslate2's (Q, K, V fused for self-attention, K, V for cross)."""
    if not attention.use_bias:
        raise UserError(
            f"CTranslate2 export needs attention projections with biases ({attention.name} has none)."
        )
    q, k, v = (
        (_numpy(getattr(attention, f"{name}_kernel")), _numpy(getattr(attention, f"{name}_bias")))
        for name in ("query", "key", "value")
    )
    d_model = attention.d_model
    flat = [(kernel.reshape(d_model, d_model), bias.reshape(d_model)) for kernel, bias in (q, k, v)]
    if self_attention:
        _linear(
            spec.linear[0],
            np.concatenate([kernel for kernel, _ in flat], axis=1),
            np.concatenate([bias for _, bias in flat]),
        )
    else:
        _linear(spec.linear[0], *flat[0])
        _linear(
            spec.linear[1],
            np.concatenate([flat[1][0], flat[2][0]], axis=1),
            np.concatenate([flat[1][1], flat[2][1]]),
        )
    output_kernel = _numpy(attention.output_kernel).reshape(d_model, d_model)
    _linear(spec.linear[-1], output_kernel, attention.output_bias)


def _feed_forward(spec, feed_forward):
    if feed_forward.activation != "relu":
        raise UserError(
            f"CTranslate2 export supports the ReLU feed-forward only; this model uses "
            f"{feed_forward.activation!r}."
        )
    _linear(spec.linear_0, feed_forward.inner_dense.kernel, feed_forward.inner_dense.bias)
    _linear(spec.linear_1, feed_forward.output_dense.kernel, feed_forward.output_dense.bias)


def transformer_spec(model, tokenizer):
    """The `ctranslate2.specs.TransformerSpec` of a built `Transformer` and its `Tokenizer`.

    Raises `UserError` (one line) for what CTranslate2 cannot run as ours does.
    """
    # Imported here: exporting needs Keras and the tokenizer (TensorFlow), translating does not.
    from keras_transformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID
    from keras_transformer.layers.positional_encoding import sinusoidal_table

    specs = _ctranslate2().specs.transformer_spec
    config = model.config
    if tokenizer.vocab_size != max(config.vocab_size, config.target_vocab):
        raise UserError(
            f"The tokenizer has {tokenizer.vocab_size} pieces but the model's vocabulary "
            f"has {max(config.vocab_size, config.target_vocab)}: they do not belong "
            f"together."
        )
    if (PAD_ID, BOS_ID, EOS_ID) != (config.pad_id, config.bos_id, config.eos_id):
        raise UserError(
            "CTranslate2 export needs the tokenizer's special ids (0 pad, 1 unk, 2 BOS, "
            "3 EOS) in the model config."
        )
    spec = specs.TransformerSpec.from_config(
        (config.num_layers, config.num_decoder_layers),
        config.num_heads,
        pre_norm=config.norm_first,
        # `return_attention`: the last layer's cross-attention, its heads averaged (as our alignments)
        alignment_layer=-1,
        alignment_heads=config.num_heads,
    )
    positions = sinusoidal_table(config.max_length, config.d_model)
    for side, stack, embedding in (
        ("encoder", model.encoder, model.source_embedding),
        ("decoder", model.decoder, model.target_embedding),
    ):
        side_spec = getattr(spec, side)
        if not embedding.scale:
            raise UserError("CTranslate2 export needs embeddings scaled by sqrt(d_model) (§3.4).")
        embeddings = side_spec.embeddings[0] if side == "encoder" else side_spec.embeddings
        embeddings.weight = _numpy(embedding.embeddings)
        side_spec.scale_embeddings = True
        side_spec.position_encodings.encodings = positions
        if config.norm_first:
            _norm(side_spec.layer_norm, stack.output_norm)
        for layer_spec, layer in zip(side_spec.layer, stack.stack_layers):
            _attention(layer_spec.self_attention, layer.self_attention, self_attention=True)
            _norm(layer_spec.self_attention.layer_norm, layer.self_attention_norm)
            if side == "decoder":
                _attention(layer_spec.attention, layer.cross_attention, self_attention=False)
                _norm(layer_spec.attention.layer_norm, layer.cross_attention_norm)
            _feed_forward(layer_spec.ffn, layer.feed_forward)
            _norm(layer_spec.ffn.layer_norm, layer.feed_forward_norm)
    if model.output_projection is None:  # tied: the target embedding matrix, no bias (§3.4)
        spec.decoder.projection.weight = _numpy(model.target_embedding.embeddings)
    else:
        _linear(
            spec.decoder.projection,
            model.output_projection.kernel,
            model.output_projection.bias if model.output_projection.use_bias else None,
        )

    pieces = [tokenizer.processor.id_to_piece(i) for i in range(tokenizer.vocab_size)]
    if len(set(pieces)) != len(pieces):
        raise UserError(
            "The SentencePiece model has duplicate pieces; CTranslate2 maps tokens by "
            "their text and needs unique pieces."
        )
    spec.register_source_vocabulary(pieces[: config.vocab_size])
    spec.register_target_vocabulary(pieces[: config.target_vocab])
    spec.config.unk_token, spec.config.eos_token = pieces[UNK_ID], pieces[EOS_ID]
    spec.config.bos_token = spec.config.decoder_start_token = pieces[BOS_ID]
    spec.config.add_source_eos = True  # as Tokenizer.encode
    spec.config.add_source_bos = False
    spec.config.layer_norm_epsilon = float(config.layer_norm_epsilon)
    return spec


def export_ctranslate2(
    model,
    tokenizer,
    out_dir,
    quantization="float32",
    beam_size=policy.BEAM_SIZE,
    length_penalty=policy.LENGTH_PENALTY,
    max_extra_length=policy.MAX_EXTRA_LENGTH,
    overwrite=False,
):
    """Writes the CTranslate2 model of `model` (a `Transformer`) into `out_dir`; returns its path.

    `beam_size`, `length_penalty`, `max_extra_length` are stored in
    `export.json` as `CTranslate2Translator`'s defaults.
    """
    from keras_transformer.data.tokenizer import Tokenizer
    from keras_transformer.model.ensemble import Ensemble

    ctranslate2 = _ctranslate2()
    if quantization not in QUANTIZATIONS:
        raise UserError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {quantization!r}.")
    if not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"tokenizer must be a keras_transformer Tokenizer; got {tokenizer!r}.")
    if isinstance(model, Ensemble):
        raise UserError(
            "CTranslate2 has no ensembles: export one model, or the ensemble to ONNX or a SavedModel."
        )
    spec = transformer_spec(model, tokenizer)
    spec.validate()
    spec.optimize(quantization=quantization)
    import keras

    import keras_transformer

    settings = dict(
        keras_transformer=keras_transformer.__version__,
        keras=keras.__version__,
        ctranslate2=ctranslate2.__version__,
        quantization=quantization,
        config=model.config.to_dict(),
        decoding=dict(
            beam_size=beam_size,
            length_penalty=length_penalty,
            max_extra_length=max_extra_length,
            length_penalty_form="gnmt",
        ),
    )
    with atomic_directory(os.path.abspath(out_dir), overwrite=overwrite) as temporary:
        spec.save(temporary)
        tokenizer.save(os.path.join(temporary, "tokenizer.model"))
        with open(os.path.join(temporary, SETTINGS_FILE), "w", encoding="utf-8") as handle:
            json.dump(settings, handle, indent=2)
    return os.path.abspath(out_dir)


def _without(pieces, eos):
    """`pieces` without a last EOS (what `score_batch` takes: it appends EOS itself)."""
    return pieces[:-1] if pieces[-1:] == [eos] else pieces


class CTranslate2Translator:
    """Translates text with a directory written by `export_ctranslate2`.

    Decoding runs in CTranslate2 and tokenization in SentencePiece's Python
    package; neither TensorFlow nor Keras is imported (the runtime install of
    docs/deployment.md has neither).

    Args:
        path: the exported directory.
        beam_size, length_penalty, max_extra_length: default to the
            export's settings (`export.json`); `length_penalty` is GNMT's
            alpha, as in `keras_transformer.decoding.search.beam_search`.
        intra_threads, inter_threads: CTranslate2's threads (keep their
            product <= physical cores).
        compute_type: CTranslate2's `compute_type` ("default": the stored one).
        batch_size: sentences per `translate_batch` call.
    """

    def __init__(
        self,
        path,
        beam_size=None,
        length_penalty=None,
        max_extra_length=None,
        intra_threads=0,
        inter_threads=1,
        compute_type="default",
        batch_size=64,
    ):
        ctranslate2 = _ctranslate2()
        import sentencepiece

        path = os.fspath(path)
        settings_path = os.path.join(path, SETTINGS_FILE)
        if not os.path.isfile(settings_path):
            raise UserError(
                f"{path} is not a keras-transformer CTranslate2 export ({SETTINGS_FILE} "
                f"is missing); write one with `keras-transformer export --format ctranslate2`."
            )
        with open(settings_path, encoding="utf-8") as handle:
            self.settings = json.load(handle)
        decoding = self.settings["decoding"]
        self.beam_size = beam_size or decoding["beam_size"]
        self.length_penalty = decoding["length_penalty"] if length_penalty is None else length_penalty
        self.max_extra_length = decoding["max_extra_length"] if max_extra_length is None else max_extra_length
        self.max_length = self.settings["config"]["max_length"]
        self.batch_size = batch_size
        self.translator = ctranslate2.Translator(
            path,
            device="cpu",
            compute_type=compute_type,
            intra_threads=intra_threads,
            inter_threads=inter_threads,
        )
        self.processor = sentencepiece.SentencePieceProcessor(
            model_file=os.path.join(path, "tokenizer.model")
        )
        # The special ids from the export's config (the tokenizer's, checked at export).
        config = self.settings["config"]
        self.eos_id = config["eos_id"]
        # The ids no translation holds (policy.never_output_ids), as CTranslate2's one-token
        # suppressed sequences: the special ids (`never`) and the pieces of control characters
        # (`controls`; `_search` says when they are passed).
        pieces, count = self.processor.id_to_piece, self.processor.get_piece_size()
        specials = [config[name] for name in policy.NEVER_OUTPUT]
        self.never = [[pieces(i)] for i in specials]
        never = policy.never_output_ids(pieces, count, specials)
        self.controls = [[pieces(i)] for i in np.flatnonzero(never).tolist() if i not in specials]
        self.control_pieces = {piece for (piece,) in self.controls}

    def tokenize(self, sentences):
        """Pieces of each sentence, truncated to `max_length - 1` (EOS is added by CTranslate2)."""
        return [
            pieces[: self.max_length - 1] for pieces in encode_each(self.processor, sentences, out_type=str)
        ]

    def translate_tokens(self, tokens):
        """Pieces in, `(pieces, score)` out per sentence (EOS not included), GNMT-ranked."""
        found = self._search(
            tokens,
            DecodingOptions(length_penalty=self.length_penalty, max_extra_length=self.max_extra_length),
        )
        return [(hypotheses[0][0], hypotheses[0][1]) for hypotheses in found]

    def _search(self, tokens, options, prefixes=None, sequences=(), ban_controls=None):
        """Per sentence, its hypotheses `(pieces without EOS, score, log-probability, attention)`,
        best first (samples: CTranslate2's order).

        The pieces of control characters are never output, as in every runtime; but
        CTranslate2's bans act before its softmax (the allowed tokens share the whole
        probability) and ours after it (a score stays the model's log-probability), which would
        shift each beam's scores by the probability the model gives those pieces (~1% a step on
        the tests' 3-epoch model: the beams then diverge). So a beam search runs without them
        banned (`ban_controls` False), and the sentences whose kept hypotheses hold one are
        searched again with them banned; samples ban them at once (True; default: sampling)."""
        ban_controls = options.sampling if ban_controls is None else ban_controls
        results = [None] * len(tokens)
        by_length = {}
        for index, pieces in enumerate(tokens):
            by_length.setdefault(len(pieces), []).append(index)
        extra = dict(
            min_decoding_length=max(0, options.min_length - 1),  # CTranslate2 counts without EOS
            disable_unk=options.disable_unk,
            no_repeat_ngram_size=options.no_repeat_ngram_size,
            repetition_penalty=options.repetition_penalty,
            suppress_sequences=self.never
            + (self.controls if ban_controls else [])
            + [list(s) for s in sequences],
            return_attention=options.return_alignments,
        )
        if options.sampling:
            _ctranslate2().set_random_seed(options.seed)
            extra.update(
                beam_size=1, num_hypotheses=options.num_return, sampling_topk=options.sampling_topk,
                sampling_topp=options.sampling_topp, sampling_temperature=options.sampling_temperature,
            )  # fmt: skip
        else:
            extra.update(beam_size=self.beam_size, num_hypotheses=self.beam_size)
        for length, indices in sorted(by_length.items()):
            # keras_transformer.decoding.search allows source length (EOS included) + extra tokens,
            # EOS included, and forces EOS at the last one: as many tokens before EOS as
            # CTranslate2 produces with one less (it counts EOS, and stops without it).
            limit = max(1, min(length + 1 + options.max_extra_length, self.max_length) - 1)
            for start in range(0, len(indices), self.batch_size):
                chunk = indices[start : start + self.batch_size]
                sources = [tokens[i] for i in chunk]
                prefix = None if prefixes is None else [prefixes[i] or None for i in chunk]
                outputs = self.translator.translate_batch(
                    sources, prefix, length_penalty=0.0, return_scores=True, return_end_token=True,
                    max_decoding_length=limit, **extra,
                )  # fmt: skip
                ranked = self._rank(sources, outputs, options, rescore=prefix is not None and any(prefix))
                for index, hypotheses in zip(chunk, ranked):
                    results[index] = hypotheses[: options.num_return]
        if ban_controls:
            return results
        again = [i for i, hyps in enumerate(results) if any(self.control_pieces & set(h[0]) for h in hyps)]
        if again:
            redone = self._search(
                [tokens[i] for i in again],
                options,
                prefixes and [prefixes[i] for i in again],
                sequences,
                True,
            )
            for index, hypotheses in zip(again, redone):
                results[index] = hypotheses
        return results

    def _rank(self, sources, outputs, options, rescore=False):
        """Each output's hypotheses by GNMT-penalized log-probability (samples keep their order).

        A hypothesis stopped at the length limit has no EOS; ours ends with a
        forced EOS whose log-probability counts, so it is rescored with EOS
        (`score_batch` appends it) before ranking. With a target prefix every
        hypothesis is rescored (CTranslate2 leaves the prefix out of its scores).
        """
        eos = self.processor.id_to_piece(self.eos_id)
        hypotheses = [[list(h) for h in output.hypotheses] for output in outputs]
        scores = [list(output.scores) for output in outputs]
        attention = [list(output.attention) or [None] * len(output.hypotheses) for output in outputs]
        unfinished = [
            (i, j)
            for i, hyps in enumerate(hypotheses)
            for j, h in enumerate(hyps)
            if rescore or not h or h[-1] != eos
        ]
        if unfinished:
            without_eos = {(i, j): _without(hypotheses[i][j], eos) for i, j in unfinished}
            rescored = self.translator.score_batch(
                [sources[i] for i, _ in unfinished], [without_eos[key] for key in unfinished]
            )
            for (i, j), result in zip(unfinished, rescored):
                hypotheses[i][j] = without_eos[i, j] + [eos]
                scores[i][j] = float(np.sum(result.log_probs))
        ranked = []
        for hyps, log_probs, weights in zip(hypotheses, scores, attention):
            entries = [
                (h[:-1], p / policy.length_penalty(len(h), options.length_penalty), p, a)
                for h, p, a in zip(hyps, log_probs, weights)
            ]
            ranked.append(entries if options.sampling else sorted(entries, key=lambda e: -e[1]))
        return ranked

    def translate(self, sentences):
        """Texts in, `(texts, scores)` out, in input order (scores: GNMT-penalized log-probabilities)."""
        results = self.translate_tokens(self.tokenize(sentences))
        texts = [self.processor.decode_pieces(pieces) for pieces, _ in results]
        return texts, np.array([score for _, score in results], np.float32)

    def translate_hypotheses(self, sentences, target_prefix=None, suppress_sequences=None, **options):
        """`Translator.translate_hypotheses` with CTranslate2: each control mapped to its own
        (docs/decoding.md). Sampling uses CTranslate2's random generator (seeded with `seed`):
        valid samples, but not ours (no runtime's generator gives ours)."""
        options = (
            DecodingOptions(length_penalty=self.length_penalty, max_extra_length=self.max_extra_length)
            .replace(**options)
            .check(self.beam_size)
        )
        sentences = list(sentences)
        tokens = self.tokenize(sentences)
        prefixes = None
        if target_prefix is not None:
            texts = ["" if p is None else p for p in target_prefix]
            prefixes = encode_each(self.processor, texts, out_type=str)
        sequences = encode_each(self.processor, suppress_sequences or [], out_type=str)
        blank = policy.blank_ids(self.processor.id_to_piece, self.processor.get_piece_size())
        content = [
            i
            for i, pieces in enumerate(tokens)
            if not all(blank[self.processor.piece_to_id(p)] for p in pieces)
        ]
        found = self._search(
            [tokens[i] for i in content], options, prefixes and [prefixes[i] for i in content], sequences
        )
        results = [[Hypothesis("", 0.0, 0.0, [] if options.return_alignments else None)] for _ in sentences]
        for index, hypotheses in zip(content, found):
            results[index] = [
                Hypothesis(
                    self.processor.decode_pieces(pieces),
                    float(score),
                    float(log_prob),
                    word_alignment(tokens[index], pieces, [int(np.argmax(a)) for a in weights])
                    if options.return_alignments
                    else None,
                )
                for pieces, score, log_prob, weights in hypotheses
            ]
        return results


def main(argv=None):
    """`python -m keras_transformer_export.ctranslate2 DIR [--beam-size N] ... < input.txt > output.txt`."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        prog="python -m keras_transformer_export.ctranslate2",
        description="Translate stdin to stdout, one line each, with a CTranslate2 export "
        "(no TensorFlow needed).",
    )
    parser.add_argument("model", help="the directory `keras-transformer export --format ctranslate2` wrote")
    parser.add_argument("--beam-size", type=int, help="default: the export's")
    parser.add_argument("--length-penalty", type=float, help="GNMT alpha (default: the export's)")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: CTranslate2's default)")
    parser.add_argument("--scores", action="store_true", help="append a tab and the score")
    args = parser.parse_args(argv)
    if args.beam_size is not None and args.beam_size < 1:
        parser.exit(2, f"{parser.prog}: error: --beam-size must be >= 1, got {args.beam_size}\n")
    if args.length_penalty is not None and not args.length_penalty >= 0:
        parser.exit(2, f"{parser.prog}: error: --length-penalty must be >= 0, got {args.length_penalty}\n")
    try:
        translator = CTranslate2Translator(
            args.model,
            beam_size=args.beam_size,
            length_penalty=args.length_penalty,
            intra_threads=args.threads,
        )
    except UserError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    lines = [line.rstrip("\n") for line in sys.stdin]
    texts, scores = translator.translate(lines)
    for text, score in zip(texts, scores):
        print(f"{text}\t{score:.4f}" if args.scores else text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The TensorFlow functions that every exported artifact is made of.

`TranslationGraphs` wraps a trained `Transformer`, its SentencePiece model
and the decoding settings, and defines each exported computation once; the
SavedModel (`keras_transformer_export.saved_model`) registers them as signatures and the ONNX
exporter (`keras_transformer_export.onnx`) converts the same functions with tf2onnx, so every
runtime runs the same graph.

| function         | inputs                                  | outputs                                   |
|------------------|-----------------------------------------|-------------------------------------------|
| `translate_text` | text string (batch,)                    | translation string (batch,), score (batch,) |
| `translate_ids`  | source_ids int32 (batch, len_src)       | target_ids int32 (batch, max_len), scores (batch,) |
| `score`          | source, target strings (batch,)         | log_likelihood float32 (batch,)           |
| `forward`        | source_ids, target_ids int32            | logits float32 (batch, len_tgt, vocab)    |
| `encode`         | source_ids                              | memory_mask, cross_key_i, cross_value_i   |
| `decoder_step`   | token_ids (rows,), memory_mask, past_*, cross_* | logits, log_probs (rows, vocab), present_* |

The decoding cache is heads-first and grows (`keras_transformer.layers.decoding_cache`):
`past_key_i` `(rows, num_heads, t, depth)` -> `present_key_i` `(rows, num_heads,
t + 1, depth)`, rows = sentences x beams; `cross_key_i` `(sentences, num_heads,
len_src, depth)`, once per sentence. The translate graphs use the growing policy
(finished sentences leave the loop).

Ids: 0 pad, 1 unk, 2 BOS, 3 EOS. Source ids end with EOS and are padded with
0; `target_ids` are EOS-terminated and padded with 0 after EOS. Sources
longer than the model's `max_length` ids are truncated to it (EOS kept last),
and ids outside the vocabulary read as `<unk>` (`checked_source_ids`).
"""

import dataclasses
import json
import os
import types

import keras
import numpy as np
import tensorflow as tf

from keras_transformer.data.tokenizer import UNK_ID, Tokenizer
from keras_transformer.decoding import policy
from keras_transformer.decoding.alignments import WORD_START
from keras_transformer.decoding.controls import OPTION_TYPES, DecodingOptions
from keras_transformer.decoding.request import align, decode, search_choice
from keras_transformer.decoding.translator import checked_request, log_likelihood, option_specs
from keras_transformer.layers.decoding_cache import DecodingCache
from keras_transformer.layers.masks import padding_mask
from keras_transformer.model.ensemble import Ensemble
from keras_transformer.model.transformer import Transformer
from keras_transformer.utils import keras_compat
from keras_transformer.utils.checks import UserError
from keras_transformer_export.cache_names import CACHE_INPUTS, cross_names, present_names


def members(model):
    """The `Transformer`s of `model`: an `Ensemble`'s members, else `[model]`."""
    return list(model.members) if isinstance(model, Ensemble) else [model]


def float32_model(model):
    """`model` itself when it computes in float32, else a float32 copy with the same weights
    (an `Ensemble`: of its members that do not).

    A model trained with a mixed policy keeps float32 variables, so the copy
    loses nothing; exported graphs then have float32 inputs, logits and
    caches on every runtime (ONNX Runtime's CPU provider has few half-precision kernels).
    """
    if isinstance(model, Ensemble):
        return Ensemble([float32_model(member) for member in model.members])
    if all(layer.compute_dtype == "float32" for layer in (model, *keras_compat.sublayers(model))):
        return model
    config = model.get_config()
    config["dtype"] = "float32"
    copy = Transformer.from_config(config)
    copy.build()
    copy.set_weights([keras.ops.convert_to_numpy(w).astype("float32") for w in model.weights])
    return copy


def _options(values):
    """The `DecodingOptions` fields' tensors (in field order) as an options object."""
    return types.SimpleNamespace(**dict(zip(OPTION_TYPES, values)))


def _outputs(found):
    """The translate graphs' outputs of `Hypotheses` (without the alignments)."""
    return {
        "target_ids": found.ids[:, 0],
        "scores": found.scores[:, 0],
        "nbest_ids": found.ids,
        "nbest_scores": found.scores,
        "nbest_log_probs": found.log_probs,
    }


class TranslationGraphs:
    """The exported computations of one model (see the module docstring).

    Args:
        model: a trained `Transformer` (made float32 if it is not), or an `Ensemble` of them:
            its members' caches side by side in every graph (`num_layers`: their decoder
            layers one after another) and their mean next-token distribution.
        tokenizer: its `Tokenizer`.
        beam_size: of the beam search, fixed into the translate graphs (4).
        **options: `DecodingOptions` fields: fixed into `serving_default` and
            `translate_ids`, the defaults of the inputs of `translate_with_options`
            and `translate.onnx` (§6.1's otherwise: α 0.6, source length + 50).
    """

    def __init__(self, model, tokenizer, beam_size=policy.BEAM_SIZE, **options):
        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(f"tokenizer must be a keras_transformer Tokenizer; got {tokenizer!r}.")
        if isinstance(beam_size, bool) or not isinstance(beam_size, int) or beam_size < 1:
            raise UserError(f"beam_size must be an integer >= 1; got {beam_size!r}.")
        try:
            self.options = DecodingOptions().replace(**options).check(beam_size)
        except ValueError as error:
            raise UserError(str(error)) from None
        self.model = float32_model(model)
        self.tokenizer = tokenizer
        self.config = self.model.config
        self.beam_size = beam_size
        self.length_penalty, self.max_extra_length = (
            self.options.length_penalty,
            self.options.max_extra_length,
        )
        # The cache's decoder layers: an ensemble's members' one after another.
        self.num_layers = sum(len(member.decoder.stack_layers) for member in members(self.model))
        self.depth = self.config.d_model // self.config.num_heads
        pieces = tokenizer.processor.id_to_piece
        self.blank = np.array(policy.blank_ids(pieces, tokenizer.vocab_size), bool)
        specials = [getattr(self.config, name) for name in policy.NEVER_OUTPUT]
        never = policy.never_output_ids(pieces, tokenizer.vocab_size, specials, self.config.target_vocab)
        self.never = np.array(never, bool)  # the ids no search outputs (a constant of every graph)

    # ------------------------------------------------------------- signatures
    def specs(self, name):
        """The `tf.TensorSpec`s (named as the inputs) of the function `name`."""
        if name == "request_plan":
            name = "translate_ids_with_options"
        ids = tf.TensorSpec([None, None], tf.int32, name="source_ids")
        cache = [None, self.config.num_heads, None, self.depth]
        return {
            "translate_text": [tf.TensorSpec([None], tf.string, name="text")],
            "source_ids": [tf.TensorSpec([None], tf.string, name="text")],
            "translate_ids": [ids],
            "score": [
                tf.TensorSpec([None], tf.string, name="source"),
                tf.TensorSpec([None], tf.string, name="target"),
            ],
            "translate_ids_with_options": [
                ids,
                tf.TensorSpec([None, None], tf.int32, name="target_prefix"),
                tf.TensorSpec([None, None], tf.int32, name="suppress_sequences"),
                tf.TensorSpec([None], tf.int32, name="sentence_ids"),
                *option_specs(),
            ],
            "translate_with_options": [
                tf.TensorSpec([None], tf.string, name="text"),
                tf.TensorSpec([None], tf.string, name="target_prefix"),
                tf.TensorSpec([None], tf.string, name="suppress_sequences"),
                *option_specs(),
            ],
            "align": [ids, tf.TensorSpec([None, None, None], tf.int32, name="target_ids")],
            "forward": [ids, tf.TensorSpec([None, None], tf.int32, name="target_ids")],
            "encode": [ids],
            "decoder_step": [
                tf.TensorSpec([None], tf.int32, name="token_ids"),
                tf.TensorSpec([None, 1, None], tf.bool, name="memory_mask"),
                *[
                    tf.TensorSpec(cache, tf.float32, name=f"{kind}_{i}")
                    for kind in self.cache_names()
                    for i in range(self.num_layers)
                ],
            ],
        }[name]

    def function(self, name, jit_compile=False):
        """`name` as a `tf.function` with its input signature (traced on first use; no autograph:
        the functions' control flow is explicit)."""
        return tf.function(
            getattr(self, name), input_signature=self.specs(name), jit_compile=jit_compile, autograph=False
        )

    @staticmethod
    def cache_names():
        """Kinds of decoder_step cache inputs: past self-attention, then cross-attention keys/values."""
        return CACHE_INPUTS

    # ------------------------------------------------------------- functions
    def translate_text(self, text):
        """Strings `(batch,)` -> `{"translation": strings, "score": float32}` (beam search)."""
        result = self.translate_ids(self.source_ids(text, repair_utf8=True))
        return {"translation": self.tokenizer.decode(result["target_ids"]), "score": result["scores"]}

    def translate_ids(self, source_ids):
        """Source ids `(batch, len_src)` -> `{"target_ids": (batch, max_len), "scores": (batch,)}`:
        the best hypothesis under the export's options (a source without content: empty)."""
        source_ids = self.checked_source_ids(source_ids)
        found = decode(
            self.model, source_ids, self.options, self.beam_size, blank=self.blank, cache_policy="growing",
            never=self.never,
        )  # fmt: skip
        return {"target_ids": found.ids[:, 0], "scores": found.scores[:, 0]}

    def translate_ids_with_options(
        self, source_ids, target_prefix, suppress_sequences, sentence_ids, *options
    ):
        """`translate_ids` with a request's options as inputs (`DecodingOptions` fields, scalars);
        `translate.onnx` has their export values as defaults.

        Args:
            source_ids: int32 `(batch, len_src)`.
            target_prefix: int32 `(batch, width)` padded with 0 (a row of 0: no prefix), or
                `(0, 0)`: none.
            suppress_sequences: int32 `(count, width)` padded with 0; `(0, 0)`: none.
            sentence_ids: int32 `(batch,)`, each row's index in the request (sampling's key),
                or `(0,)`: the rows' own.

        Returns `target_ids` `(batch, max_len)` and `scores` `(batch,)` (the best, as
        `translate_ids`), `nbest_ids` `(batch, num_return, max_len)`, `nbest_scores`,
        `nbest_log_probs` `(batch, num_return)` and `alignments` `(batch, num_return,
        max_len)` (-1 unless `return_alignments`).
        """
        plan = self.request_plan(source_ids, target_prefix, suppress_sequences, sentence_ids, *options)
        found = decode(
            self.model, plan["planned_source_ids"], _options(options), self.beam_size,
            plan["planned_target_prefix"], suppress_sequences, plan["planned_sentence_ids"], self.blank,
            cache_policy="growing", never=self.never,
        )  # fmt: skip
        return {**_outputs(found), "alignments": found.alignments}

    def request_plan(self, source_ids, target_prefix, suppress_sequences, sentence_ids, *options):
        """A request made ready for `decode`, and which search it runs.

        Returns `planned_source_ids` (`checked_source_ids`, then the request's checks:
        `InvalidArgument` for bad options), `planned_target_prefix` with a row per sentence
        (the `(0, 0)` default becomes a padding column per sentence), `planned_sentence_ids`
        (the `(0,)` default becomes the rows' own), and the bools `sampling` and
        `with_controls` (`keras_transformer.decoding.request.search_choice`).
        """
        options = _options(options)
        source_ids = self.checked_source_ids(source_ids)
        batch = tf.shape(source_ids)[0]
        prefix_rows = tf.shape(target_prefix)[0]
        target_prefix = tf.pad(target_prefix, [[0, tf.maximum(batch - prefix_rows, 0)], [0, 1]])
        sentence_ids = tf.concat([sentence_ids, tf.range(tf.shape(sentence_ids)[0], batch)], axis=0)
        rows_ok = tf.logical_and(
            tf.reduce_any(tf.equal(prefix_rows, [0, batch])), tf.equal(tf.shape(sentence_ids)[0], batch)
        )
        message = "target_prefix and sentence_ids need one row per source sentence (or none)"
        with tf.control_dependencies([tf.debugging.Assert(rows_ok, [message])]):
            source_ids = checked_request(
                self.config, self.beam_size, source_ids, options, target_prefix, suppress_sequences
            )
        sampling, with_controls = search_choice(self.config, options, target_prefix, suppress_sequences)
        return {
            "planned_source_ids": source_ids,
            "planned_target_prefix": target_prefix,
            "planned_sentence_ids": sentence_ids,
            "sampling": sampling,
            "with_controls": with_controls,
        }

    def search_function(self, search):
        """`translate_ids_with_options` (without alignments) that runs the one `search` of
        `keras_transformer.decoding.request.SEARCHES` on a request `request_plan` prepared."""

        def translate(source_ids, target_prefix, suppress_sequences, sentence_ids, *options):
            found = decode(
                self.model, source_ids, _options(options), self.beam_size, target_prefix, suppress_sequences,
                sentence_ids, self.blank, cache_policy="growing", search=search, never=self.never,
            )  # fmt: skip
            return _outputs(found)

        return tf.function(
            translate, input_signature=self.specs("translate_ids_with_options"), autograph=False
        )

    def translate_with_options(self, text, target_prefix, suppress_sequences, *options):
        """Strings in, n-best strings out, with a request's options (the SavedModel's second
        signature; TF Serving needs every input: the docs give a request with the defaults).

        Args:
            text: strings `(batch,)`.
            target_prefix: strings `(batch,)`, the start each translation is forced to
                ("": none), or `(0,)`: none.
            suppress_sequences: strings `(count,)` no translation may contain.

        Returns `translations` strings `(batch, num_return)`, `scores`, `log_probs` float32
        `(batch, num_return)` and `alignments` strings `(batch, num_return)`: Pharaoh `i-j`
        pairs of source and translation words ("" unless `return_alignments`; as
        `keras_transformer.decoding.alignments.word_alignment`).
        """
        source_ids = self.source_ids(text, repair_utf8=True)
        prefix = self._token_ids(target_prefix)
        sequences = self._token_ids(suppress_sequences)
        found = self.translate_ids_with_options(
            source_ids, prefix, sequences, tf.zeros([0], tf.int32), *options
        )
        ids = found["nbest_ids"]  # (batch, n, max_len)
        shape = tf.shape(ids)
        rows = tf.reshape(ids, [-1, shape[2]])
        texts = tf.reshape(self.tokenizer.decode(rows), shape[:2])
        aligned = self._pharaoh(
            tf.repeat(source_ids, shape[1], axis=0), rows, tf.reshape(found["alignments"], [-1, shape[2]])
        )
        return {
            "translations": texts,
            "scores": found["nbest_scores"],
            "log_probs": found["nbest_log_probs"],
            "alignments": tf.reshape(aligned, shape[:2]),
        }

    def _token_ids(self, strings):
        """Strings `(count,)` -> their pieces' ids `(count, width)`, padded with 0 (no BOS/EOS)."""
        ragged = self.tokenizer.tokenize(strings, repair_utf8=True)
        return tf.cast(ragged.to_tensor(default_value=self.config.pad_id), tf.int32)

    def _pharaoh(self, source_ids, target_ids, alignments):
        """Word-level Pharaoh strings `(rows,)` of token alignments `(rows, max_len)`, by the rule of
        `keras_transformer.decoding.alignments.word_alignment` (its test pins the two alike)."""
        pieces = [self.tokenizer.processor.id_to_piece(i) for i in range(self.tokenizer.vocab_size)]
        starts = tf.constant([piece.startswith(WORD_START) for piece in pieces])
        special = tf.constant([piece in ("<pad>", "<s>", "</s>") for piece in pieces])

        def words(ids):  # (rows, length): each piece's word index, -1 for special pieces
            is_special = tf.gather(special, ids)
            first = tf.equal(tf.cumsum(tf.cast(tf.logical_not(is_special), tf.int32), axis=1), 1)
            begins = tf.logical_and(tf.logical_or(tf.gather(starts, ids), first), tf.logical_not(is_special))
            return tf.where(is_special, -1, tf.cumsum(tf.cast(begins, tf.int32), axis=1) - 1)

        source_words = words(source_ids)
        attended = tf.gather(source_words, tf.maximum(alignments, 0), batch_dims=1)
        target_words = words(target_ids)
        valid = tf.logical_and(alignments >= 0, tf.logical_and(attended >= 0, target_words >= 0))
        large = tf.constant(2**30, tf.int32)
        codes = tf.sort(tf.where(valid, attended * 65536 + target_words, large), axis=1)
        previous = tf.concat([tf.fill([tf.shape(codes)[0], 1], -1), codes[:, :-1]], axis=1)
        keep = tf.logical_and(tf.not_equal(codes, previous), codes < large)
        pairs = tf.strings.as_string(codes // 65536) + "-" + tf.strings.as_string(codes % 65536)
        return tf.strings.reduce_join(tf.ragged.boolean_mask(pairs, keep), axis=1, separator=" ")

    def align(self, source_ids, target_ids):
        """`{"alignments": (batch, n, max_len)}`: each hypothesis token's most attended source
        position (`keras_transformer.decoding.request.align`; -1 at EOS and after)."""
        return {"alignments": align(self.model, source_ids, target_ids)}

    def checked_source_ids(self, source_ids):
        """What `translate_ids` decodes from any int32 `(batch, len)` a client sends, by one rule
        in every runtime (the graph does it; ONNX has no assertion op to refuse with):

        - an id outside the vocabulary (negative, or >= vocab_size) is read as `<unk>`;
        - a row longer than the model's `max_length` positions is cut to its first
          `max_length - 1` ids plus EOS (what the text signatures do to a long sentence);
        - an empty batch `(0, 0)` gets one padding column (the encoder's products need an
          inner size); it decodes to an empty batch.
        """
        config = self.config
        outside = tf.logical_or(source_ids < 0, source_ids >= config.vocab_size)
        source_ids = tf.where(outside, tf.constant(UNK_ID, tf.int32), source_ids)
        limit = config.max_length
        lengths = tf.reduce_sum(tf.cast(tf.not_equal(source_ids, config.pad_id), tf.int32), axis=1)
        last = tf.where(
            (lengths > limit)[:, None], tf.constant(config.eos_id, tf.int32), source_ids[:, limit - 1 : limit]
        )  # empty when the input is no longer than `limit - 1`
        source_ids = tf.concat([source_ids[:, : limit - 1], last], axis=1)
        return tf.pad(source_ids, [[0, 0], [0, tf.maximum(1 - tf.shape(source_ids)[1], 0)]])

    def score(self, source, target):
        """Log-likelihood log p(target | source) of each pair `(batch,)` (sum over target tokens + EOS).

        Both sides are tokenized and truncated to the model's `max_length` as
        in training; an empty target scores its EOS alone.
        """
        source_ids = self.source_ids(source, repair_utf8=True)
        pieces = self.tokenizer.tokenize(target, repair_utf8=True)[:, : self.config.max_length - 1]
        return {"log_likelihood": log_likelihood(self.model, source_ids, tf.cast(pieces, tf.int32))}

    def forward(self, source_ids, target_ids):
        """Teacher-forced logits `(batch, len_tgt, vocab)` (target_ids = BOS + target)."""
        logits = self.model({"source_ids": source_ids, "target_ids": target_ids}, training=False)
        return {"logits": tf.cast(logits, tf.float32)}

    def encode(self, source_ids):
        """Encoder half of the split graphs: the padding mask and each decoder layer's cross K/V.

        Returns `memory_mask` bool `(batch, 1, len_src)` and `cross_key_i`,
        `cross_value_i` float32 `(batch, num_heads, len_src, depth)`, once per sentence.
        """
        memory = self.model.encode(source_ids, training=False)
        cache = self.model.init_cache(memory)
        cross = cache.cross_key + cache.cross_value
        return {
            "memory_mask": padding_mask(source_ids, self.config.pad_id),
            **dict(zip(cross_names(self.num_layers), cross)),
        }

    def decoder_step(self, token_ids, memory_mask, *caches):
        """One cached decoding step: logits for the next position and the grown self caches.

        `token_ids` `(rows,)` (rows = sentences x beams, a sentence's beams in a
        row), `memory_mask` `(sentences, 1, len_src)`; `caches` are `past_key_0..,
        past_value_0.., cross_key_0.., cross_value_0..` in this order
        (`cache_names`); the past ones `(rows, num_heads, t, depth)` hold the `t`
        positions decoded so far (0 at the first step, which decodes BOS).
        Returns `logits` and their `log_probs` `(rows, vocab)` (the log-softmax
        that beam search adds up, computed here so that every runtime rounds it
        the same way), and `present_key_i`, `present_value_i` `(rows, num_heads,
        t + 1, depth)`.
        """
        cache = DecodingCache.from_flat(caches, self.num_layers)
        logits, cache = self.model.decode_step(token_ids, None, cache, memory_mask)
        present = dict(zip(present_names(self.num_layers), cache.self_key + cache.self_value))
        return {"logits": logits, "log_probs": tf.nn.log_softmax(logits, axis=-1), **present}

    # ------------------------------------------------------------- helpers
    def write_assets(self, directory, **extra):
        """Writes `tokenizer.model` and `export.json` (`metadata()` plus `extra`) into `directory`."""
        os.makedirs(directory, exist_ok=True)
        self.tokenizer.save(os.path.join(directory, "tokenizer.model"))
        with open(os.path.join(directory, "export.json"), "w", encoding="utf-8") as handle:
            json.dump({**self.metadata(), **extra}, handle, indent=2, sort_keys=True)

    def metadata(self):
        """What an export was made from: versions, model config and decoding settings."""
        import keras_transformer

        return {
            "keras_transformer": keras_transformer.__version__,
            "tensorflow": tf.__version__,
            "keras": keras.__version__,
            "model": self.model_metadata(),
            "decoding": {"beam_size": self.beam_size, **dataclasses.asdict(self.options)},
        }

    def model_metadata(self):
        """`export.json`'s `model`: the config (an ensemble: its first member's, and every member's
        under `ensemble`, from which `cache_names.cache_layers` counts the joint cache's layers)."""
        config = self.config.to_dict()
        if isinstance(self.model, Ensemble):
            config["ensemble"] = [member.config.to_dict() for member in self.model.members]
        return config

    def source_ids(self, text, repair_utf8=False):
        """Strings -> padded, EOS-terminated source ids, truncated to `max_length`."""
        return self.tokenizer.encode(
            text, max_length=self.config.max_length, pad_to_max_length=False, repair_utf8=repair_utf8
        )

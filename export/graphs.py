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

import json
import os

import keras
import tensorflow as tf

from keras_transformer.data.tokenizer import UNK_ID, Tokenizer
from keras_transformer.decoding import policy
from keras_transformer.decoding.search import beam_search
from keras_transformer.decoding.translator import log_likelihood
from keras_transformer.layers.decoding_cache import DecodingCache
from keras_transformer.layers.masks import padding_mask
from keras_transformer.model.transformer import Transformer
from keras_transformer.utils import keras_compat
from keras_transformer.utils.checks import UserError
from keras_transformer_export.cache_names import CACHE_INPUTS, cross_names, present_names


def float32_model(model):
    """`model` itself when it computes in float32, else a float32 copy with the same weights.

    A model trained with a mixed policy keeps float32 variables, so the copy
    loses nothing; exported graphs then have float32 inputs, logits and
    caches on every runtime (ONNX Runtime's CPU provider has few half-precision kernels).
    """
    if all(layer.compute_dtype == "float32" for layer in (model, *keras_compat.sublayers(model))):
        return model
    config = model.get_config()
    config["dtype"] = "float32"
    copy = Transformer.from_config(config)
    copy.build()
    copy.set_weights([keras.ops.convert_to_numpy(w).astype("float32") for w in model.weights])
    return copy


class TranslationGraphs:
    """The exported computations of one model (see the module docstring).

    Args:
        model: a trained `Transformer` (made float32 if it is not).
        tokenizer: its `Tokenizer`.
        beam_size, length_penalty, max_extra_length: of `beam_search`, fixed
            into the translate graphs (4, 0.6, 50 as in the paper).
    """

    def __init__(
        self,
        model,
        tokenizer,
        beam_size=policy.BEAM_SIZE,
        length_penalty=policy.LENGTH_PENALTY,
        max_extra_length=policy.MAX_EXTRA_LENGTH,
    ):
        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(f"tokenizer must be a keras_transformer Tokenizer; got {tokenizer!r}.")
        if isinstance(beam_size, bool) or not isinstance(beam_size, int) or beam_size < 1:
            raise UserError(f"beam_size must be an integer >= 1; got {beam_size!r}.")
        if not (isinstance(length_penalty, (int, float)) and length_penalty >= 0):
            raise UserError(f"length_penalty must be a number >= 0; got {length_penalty!r}.")
        if (
            isinstance(max_extra_length, bool)
            or not isinstance(max_extra_length, int)
            or max_extra_length < 0
        ):
            raise UserError(f"max_extra_length must be an integer >= 0; got {max_extra_length!r}.")
        self.model = float32_model(model)
        self.tokenizer = tokenizer
        self.config = self.model.config
        self.beam_size, self.length_penalty = beam_size, length_penalty
        self.max_extra_length = max_extra_length
        self.num_layers = len(self.model.decoder.stack_layers)
        self.depth = self.config.d_model // self.config.num_heads

    # ------------------------------------------------------------- signatures
    def specs(self, name):
        """The `tf.TensorSpec`s (named as the inputs) of the function `name`."""
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
        """`name` as a `tf.function` with its input signature (traced on first use)."""
        return tf.function(getattr(self, name), input_signature=self.specs(name), jit_compile=jit_compile)

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
        """Source ids `(batch, len_src)` -> `{"target_ids": (batch, max_len), "scores": (batch,)}`."""
        source_ids = self.checked_source_ids(source_ids)
        result = beam_search(
            self.model,
            source_ids,
            beam_size=self.beam_size,
            length_penalty=self.length_penalty,
            max_extra_length=self.max_extra_length,
            cache_policy="growing",
        )
        return {"target_ids": result.ids, "scores": result.scores}

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
            "model": self.config.to_dict(),
            "decoding": {
                "beam_size": self.beam_size,
                "length_penalty": self.length_penalty,
                "max_extra_length": self.max_extra_length,
            },
        }

    def source_ids(self, text, repair_utf8=False):
        """Strings -> padded, EOS-terminated source ids, truncated to `max_length`."""
        return self.tokenizer.encode(
            text, max_length=self.config.max_length, pad_to_max_length=False, repair_utf8=repair_utf8
        )

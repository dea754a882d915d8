"""The Transformer encoder-decoder model of Vaswani et al. (2017), Figure 1.

Shape legend: batch, len_src, len_tgt, d_model, vocab (target vocabulary).

    inputs  {"source_ids": int (batch, len_src), "target_ids": int (batch, len_tgt)}
    outputs logits float32 (batch, len_tgt, vocab)

`target_ids` is the right-shifted target (BOS y_1 ... y_{n-1}); the labels are
y_1 ... y_n EOS. Padding (pad_id) is masked out of every attention.
"""

import dataclasses

import keras

from keras_transformer.layers.decoder import Decoder
from keras_transformer.layers.decoding_cache import DecodingCache
from keras_transformer.layers.embedding import TokenEmbedding
from keras_transformer.layers.encoder import Encoder
from keras_transformer.layers.masks import padding_mask
from keras_transformer.layers.multi_head_attention import ATTENTION_MODES, MultiHeadAttention
from keras_transformer.model.config import TransformerConfig
from keras_transformer.utils import keras_compat
from keras_transformer.utils.checks import check_choice
from keras_transformer.utils.registration import register

INPUT_KEYS = ("source_ids", "target_ids")
_CONFIG_FIELDS = {field.name for field in dataclasses.fields(TransformerConfig)}


@register
class Transformer(keras_compat.DistributedFitFixes, keras.Model):
    """Encoder-decoder Transformer (§3) returning float32 logits.

    Args:
        config: a `TransformerConfig` or its dict; any `TransformerConfig`
            field may also be given (or overridden) as a keyword argument.
        name, dtype, ...: as `keras.Model`; `dtype="mixed_float16"` or a
            global mixed policy runs in half precision with float32 logits.

    Call arguments:
        inputs: dict with `source_ids` `(batch, len_src)` and `target_ids`
            `(batch, len_tgt)` int tensors.
        training: enables dropout.

    Returns:
        logits `(batch, len_tgt, vocab)` float32.

    Weights: the embedding matrix is shared three ways (source, target,
    pre-softmax; §3.4) unless `share_embeddings`/`tie_output` say otherwise.

    Example:
    >>> import numpy as np
    >>> model = Transformer.from_preset("tiny", vocab_size=100)
    >>> ids = np.array([[5, 6, 7, 0]])
    >>> model({"source_ids": ids, "target_ids": ids}).shape
    TensorShape([1, 4, 100])
    """

    def __init__(self, config=None, **kwargs):
        overrides = {key: kwargs.pop(key) for key in list(kwargs) if key in _CONFIG_FIELDS}
        if config is None:
            config = TransformerConfig(**overrides)
        elif isinstance(config, dict):
            config = TransformerConfig.from_dict({**config, **overrides})
        elif overrides:
            config = config.replace(**overrides)
        super().__init__(**kwargs)
        self.config = config
        # A training choice, not part of the saved config: see `train_step`.
        self.fused_step = None
        if config.share_embeddings:
            self.token_embedding = self._make_embedding(config.vocab_size, "token_embedding")
        else:
            self.source_token_embedding = self._make_embedding(config.vocab_size, "source_embedding")
            self.target_token_embedding = self._make_embedding(config.target_vocab, "target_embedding")
        self.encoder = Encoder(
            config.num_layers, **config.layer_arguments(), dtype=self.dtype_policy, name="encoder"
        )
        self.decoder = Decoder(
            config.num_decoder_layers, **config.layer_arguments(), dtype=self.dtype_policy, name="decoder"
        )
        self.output_projection = None
        if not config.tie_output:
            self.output_projection = keras.layers.Dense(
                config.target_vocab, dtype="float32", name="output_projection"
            )

    def _make_embedding(self, vocab_size, name):
        return TokenEmbedding(vocab_size, self.config.d_model, dtype=self.dtype_policy, name=name)

    @property
    def source_embedding(self):
        return self.token_embedding if self.config.share_embeddings else self.source_token_embedding

    @property
    def target_embedding(self):
        return self.token_embedding if self.config.share_embeddings else self.target_token_embedding

    @classmethod
    def from_preset(cls, preset, **overrides):
        """A built model of preset `tiny`, `small`, `base` or `big` (see `TransformerConfig`)."""
        model = cls(TransformerConfig.from_preset(preset, **overrides))
        model.build()
        return model

    def build(self, input_shape=None):
        hidden_shape = (None, None, self.config.d_model)
        # Children are built once (a second `build` would add their weights again).
        for embedding in {id(e): e for e in (self.source_embedding, self.target_embedding)}.values():
            if not embedding.built:
                embedding.build()
        if not self.encoder.built:
            self.encoder.build(hidden_shape)
        if not self.decoder.built:
            self.decoder.build(hidden_shape, hidden_shape)
        if self.output_projection is not None and not self.output_projection.built:
            self.output_projection.build(hidden_shape)

    def call(self, inputs, training=None):
        source_ids, target_ids = _unpack_inputs(inputs)
        source_mask = padding_mask(source_ids, self.config.pad_id)  # built once, used by both halves
        memory = self._encode(source_ids, source_mask, training)
        return self._decode(target_ids, memory, source_mask, training)

    def encode(self, source_ids, training=False):
        """Source ids `(batch, len_src)` -> memory `(batch, len_src, d_model)`."""
        return self._encode(source_ids, padding_mask(source_ids, self.config.pad_id), training)

    def decode(self, target_ids, memory, source_ids, training=False):
        """Right-shifted target ids `(batch, len_tgt)` + memory -> logits `(batch, len_tgt, vocab)`."""
        return self._decode(target_ids, memory, padding_mask(source_ids, self.config.pad_id), training)

    def _encode(self, source_ids, source_mask, training):
        return self.encoder(self.source_embedding(source_ids), attention_mask=source_mask, training=training)

    def _decode(self, target_ids, memory, source_mask, training):
        """`decode` with the source padding mask `(batch, 1, len_src)` already built."""
        return self.project(self.decoder_output(target_ids, memory, source_mask, training))

    def decoder_output(self, target_ids, memory, source_mask, training):
        """The last decoder layer's output `(batch, len_tgt, d_model)`, before `project`."""
        return self.decoder(
            self.target_embedding(target_ids),
            memory,
            target_mask=padding_mask(target_ids, self.config.pad_id),
            memory_mask=source_mask,
            training=training,
        )

    def init_cache(self, memory, max_length=None, beam_size=1):
        """The incremental-decoding cache for `memory` `(sentences, len_src, d_model)`.

        Cross-attention keys/values are projected once per sentence (one fused
        K/V product per layer). The self-attention caches have `sentences *
        beam_size` rows (a sentence's beams in a row) and, with `max_length`,
        that many preallocated positions (fixed-size policy: XLA, JAX); without
        it, 0 positions and they grow by one per step (`DecodingCache` says
        when to use which). A `DecodingCache` of per-decoder-layer tuples:
        `self_key`, `self_value` `(sentences * beam_size, num_heads,
        max_length or 0, depth)`, `cross_key`, `cross_value` `(sentences,
        num_heads, len_src, depth)`.
        """
        rows = keras.ops.shape(memory)[0] * beam_size
        config = self.config
        shape = (
            rows,
            config.num_heads,
            0 if max_length is None else max_length,
            config.d_model // config.num_heads,
        )
        layers = self.decoder.stack_layers
        memory = keras.ops.cast(memory, self.compute_dtype)
        cross = [layer.cross_attention.project_key_value(memory) for layer in layers]
        return DecodingCache(
            self_key=tuple(keras.ops.zeros(shape, self.compute_dtype) for _ in layers),
            self_value=tuple(keras.ops.zeros(shape, self.compute_dtype) for _ in layers),
            cross_key=tuple(keys for keys, _ in cross),
            cross_value=tuple(values for _, values in cross),
        )

    def decode_step(self, token_ids, step, cache, memory_mask, cache_history=None, projection_kernel=None):
        """One incremental decoding step (inference).

        Args:
            token_ids: int `(rows,)`, the target token at position `step`
                (BOS at step 0); `rows` is a multiple of the cache's sentences
                (the beams of a sentence in a row).
            step: scalar int for a fixed-size cache; None for a growing one
                (the position is the number of cached positions).
            cache: from `init_cache` (or the previous step).
            memory_mask: `padding_mask(source_ids)`, bool `(sentences, 1, len_src)`.
            cache_history: with a fixed-size cache, optional `CacheHistory`: the
                self-attention cache row each row reads at each position (a beam's
                history, so that the cache is written in place and never reordered).
            projection_kernel: optional float32 `(d_model, vocab)`, the tied projection's matrix
                (the embeddings transposed) computed once by the caller: a search loop under XLA
                that transposes it inside the loop gets a product with a transposed operand,
                1.6x slower at 4 rows on CPU. Only for a model with tied embeddings.

        Returns:
            `(logits (rows, vocab) float32 for the next position, cache)`.
        """
        embedded = self.target_embedding(keras.ops.expand_dims(token_ids, axis=1))
        history = {} if cache_history is None else cache_history._asdict()
        history = {f"cache_{name}": value for name, value in history.items()}  # cache_rows, cache_block
        hidden, cache = self.decoder(
            embedded, memory_mask=memory_mask, cache=cache, cache_step=step, **history
        )
        # Project the one position as a matrix `(rows, d_model)`: the exported step is then one
        # `Gemm` that reads the tied embedding as stored (keras_transformer_export.graph_rewrites).
        if projection_kernel is None:
            return self.project(hidden[:, 0]), cache
        if self.output_projection is not None:
            raise ValueError(
                "projection_kernel is the tied embeddings' matrix; this model has its own projection "
                "(tie_output=False): call decode_step without projection_kernel."
            )
        return keras.ops.matmul(keras.ops.cast(hidden[:, 0], "float32"), projection_kernel), cache

    def step_projection_kernel(self):
        """`decode_step`'s `projection_kernel`: the tied embeddings transposed, float32 `(d_model,
        vocab)`; None for a model with its own projection (`tie_output=False`)."""
        if self.output_projection is not None:
            return None
        return keras.ops.transpose(keras.ops.cast(self.target_embedding.embeddings, "float32"))

    def project(self, hidden):
        """Decoder output `(batch, len, d_model)` (or `(rows, d_model)`) -> float32 logits `(..., vocab)`."""
        if self.output_projection is not None:
            return self.output_projection(hidden)
        return self.target_embedding.project(hidden)

    def projection_weights(self):
        """`(kernel (vocab, d_model), bias (vocab,) or None)` with `project(h) = h @ kernel^T + bias`."""
        if self.output_projection is None:
            return self.target_embedding.embeddings, None
        dense = self.output_projection
        return keras.ops.transpose(dense.kernel), dense.bias

    def attention_weights(self, inputs):
        """All attention weights of an inference pass, for inspection and plots.

        Returns a dict of lists (one entry per layer) of float32 tensors
        `(batch, num_heads, len_q, len_k)`: `encoder_self`, `decoder_self`,
        `decoder_cross`.
        """
        source_ids, target_ids = _unpack_inputs(inputs)
        source_mask = padding_mask(source_ids, self.config.pad_id)
        memory, encoder_self = self.encoder(
            self.source_embedding(source_ids), source_mask, return_weights=True, training=False
        )
        _, decoder_self, decoder_cross = self.decoder(
            self.target_embedding(target_ids),
            memory,
            padding_mask(target_ids, self.config.pad_id),
            source_mask,
            return_weights=True,
            training=False,
        )
        return {"encoder_self": encoder_self, "decoder_self": decoder_self, "decoder_cross": decoder_cross}

    def set_attention_mode(self, mode):
        """Switches every attention layer to `"batched"` or `"per_head"` (same weights).

        Compiled train/predict functions are dropped so they retrace in the
        new mode.
        """
        check_choice("mode", mode, ATTENTION_MODES)
        for layer in keras_compat.sublayers(self):
            if isinstance(layer, MultiHeadAttention):
                layer.mode = mode
            elif hasattr(layer, "attention_mode"):
                layer.attention_mode = mode
        self.config = self.config.replace(attention_mode=mode)
        self.train_function = self.test_function = self.predict_function = None

    def train_step(self, *args):
        """One `fit` step: the installed `fused_step` where it applies, else Keras' own.

        The TensorFlow and PyTorch trainers call `train_step(data)`, JAX's
        `train_step(state, data)`; both reach Keras' step unchanged. With
        `fused_step` set (`compile_transformer` sets the TensorFlow-only
        `training.fused_step.FusedOutputLossStep`), that step runs and returns
        the logs, or None to fall back (it logs why).
        """
        if self.fused_step is not None and len(args) == 1:
            if not self.built:
                self.build()  # as the model's first call would; the fused step never calls it
            logs = self.fused_step(self, args[0])
            if logs is not None:
                return self.logs_for_workers(logs)
        logs = super().train_step(*args)
        return self.logs_for_workers(logs) if len(args) == 1 else logs

    def test_step(self, *args):
        logs = super().test_step(*args)
        return self.logs_for_workers(logs) if len(args) == 1 else logs

    def get_config(self):
        return {
            "name": self.name,
            "trainable": self.trainable,
            "dtype": keras.dtype_policies.serialize(self.dtype_policy),
            "config": self.config.to_dict(),
        }

    @classmethod
    def from_config(cls, config):
        return cls(**config)


def _unpack_inputs(inputs):
    if not isinstance(inputs, dict) or any(key not in inputs for key in INPUT_KEYS):
        got = sorted(inputs) if isinstance(inputs, dict) else type(inputs).__name__
        raise ValueError(
            f"Transformer expects a dict with keys {list(INPUT_KEYS)} "
            f"(int token ids of shape (batch, length)); got {got}."
        )
    return inputs["source_ids"], inputs["target_ids"]

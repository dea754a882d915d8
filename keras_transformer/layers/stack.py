"""What the encoder and decoder stacks (§3.1) have in common: the sublayer
hyper-parameters, positional encoding + embedding dropout at the bottom, N
identical layers, and (pre-norm only) a final layer norm at the top.

Shape legend: (batch, length, d_model) in, the same out.
"""

import keras

from keras_transformer.layers.dropout import Dropout
from keras_transformer.layers.positional_encoding import SinusoidalPositionalEncoding
from keras_transformer.utils.checks import check_positive_int, check_rate

# Constructor arguments shared by EncoderLayer, DecoderLayer, Encoder, Decoder.
LAYER_ARGUMENTS = (
    "d_model",
    "num_heads",
    "d_ff",
    "dropout_rate",
    "attention_dropout_rate",
    "activation_dropout_rate",
    "layer_norm_epsilon",
    "norm_first",
    "attention_mode",
)


class LayerArguments:
    """Stores and serializes the `LAYER_ARGUMENTS` of a layer."""

    def store_layer_arguments(self, arguments):
        check_positive_int("d_model", arguments["d_model"])
        check_positive_int("num_heads", arguments["num_heads"])
        check_positive_int("d_ff", arguments["d_ff"])
        check_rate("dropout_rate", arguments["dropout_rate"])
        for name in LAYER_ARGUMENTS:
            setattr(self, name, arguments[name])

    def layer_arguments(self):
        return {name: getattr(self, name) for name in LAYER_ARGUMENTS}

    def get_config(self):
        config = super().get_config()
        config.update(self.layer_arguments())
        return config


class TransformerStack(LayerArguments, keras.layers.Layer):
    """Base of `Encoder` and `Decoder`; subclasses set `layer_class`."""

    layer_class = None

    def __init__(self, num_layers, max_length, layer_arguments, **kwargs):
        super().__init__(**kwargs)
        check_positive_int("num_layers", num_layers)
        self.store_layer_arguments(layer_arguments)
        self.num_layers, self.max_length = num_layers, max_length
        self.positional_encoding = SinusoidalPositionalEncoding(
            max_length, dtype=self.dtype_policy, name="positional_encoding"
        )
        self.embedding_dropout = Dropout(self.dropout_rate, dtype=self.dtype_policy, name="embedding_dropout")
        self.stack_layers = [
            self.layer_class(**self.layer_arguments(), dtype=self.dtype_policy, name=f"layer_{i}")
            for i in range(num_layers)
        ]
        self.output_norm = None
        if self.norm_first:
            self.output_norm = keras.layers.LayerNormalization(
                epsilon=self.layer_norm_epsilon, dtype=self.dtype_policy, name="output_norm"
            )

    def build(self, inputs_shape, memory_shape=None):
        self.positional_encoding.build(inputs_shape)
        for layer in self.stack_layers:
            layer.build(inputs_shape, *([memory_shape] if memory_shape is not None else []))
        if self.output_norm is not None:
            self.output_norm.build(inputs_shape)

    def embed_positions(self, inputs, training=None, offset=0):
        """Positional encoding (from position `offset`) + embedding dropout (§3.5, §5.4)."""
        return self.embedding_dropout(self.positional_encoding(inputs, offset=offset), training=training)

    def normalize_output(self, outputs):
        return outputs if self.output_norm is None else self.output_norm(outputs)

    def compute_output_shape(self, inputs_shape, memory_shape=None):
        return tuple(inputs_shape)

    def get_config(self):
        config = super().get_config()
        config.update(num_layers=self.num_layers, max_length=self.max_length)
        return config

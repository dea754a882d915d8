"""The key/value cache of incremental decoding (§3.2.3 at inference), as named tensors.

Shape legend: batch (sentences x beams), max_len (decoding steps), len_src,
num_heads, depth = d_model / num_heads.

`Transformer.init_cache` makes one; `Transformer.decode_step` returns it with
the step's keys and values written; beam search `reorder`s it by beam origin;
export flattens it (`flat` / `from_flat`) into graph inputs and outputs.
"""

from typing import NamedTuple

from keras import ops


class LayerCache(NamedTuple):
    """One decoder layer's cache: self-attention `(batch, max_len, num_heads, depth)`
    (positions decoded so far; the rest zeros) and cross-attention `(batch, len_src,
    num_heads, depth)` (the memory projected once)."""

    self_key: object
    self_value: object
    cross_key: object
    cross_value: object


class DecodingCache(NamedTuple):
    """Per decoder layer (tuples of `num_layers` tensors), as `LayerCache`'s fields.

    A NamedTuple: a loop variable of `keras.ops.while_loop` on every backend
    (a pytree on JAX, a nest in TensorFlow) and of exported graphs.
    """

    self_key: tuple
    self_value: tuple
    cross_key: tuple
    cross_value: tuple

    @property
    def num_layers(self):
        return len(self.self_key)

    def layer(self, index):
        """The `LayerCache` of decoder layer `index`."""
        return LayerCache(*(tensors[index] for tensors in self))

    @classmethod
    def from_layers(cls, layer_caches):
        """The cache of a stack from its layers' `LayerCache`s, in order."""
        return cls(*(tuple(tensors) for tensors in zip(*layer_caches)))

    def with_self_attention(self, keys, values):
        """This cache with new self-attention keys and values (one per layer)."""
        return self._replace(self_key=tuple(keys), self_value=tuple(values))

    def reorder(self, indices):
        """The self-attention caches gathered along the batch by `indices` `(batch,)` (beam
        origins); the cross-attention ones are the same for every beam of a sentence."""
        return self.with_self_attention(
            [ops.take(t, indices, axis=0) for t in self.self_key],
            [ops.take(t, indices, axis=0) for t in self.self_value],
        )

    def repeat(self, times):
        """Each sentence's cache `times` times in a row: `(batch, ...)` -> `(batch * times, ...)`."""
        if times == 1:
            return self
        return DecodingCache(*(tuple(ops.repeat(t, times, axis=0) for t in tensors) for tensors in self))

    def flat(self):
        """The tensors in export order: all `self_key`s, then `self_value`s, `cross_key`s, `cross_value`s."""
        return [tensor for tensors in self for tensor in tensors]

    @classmethod
    def from_flat(cls, tensors, num_layers):
        """The inverse of `flat`."""
        tensors = list(tensors)
        if len(tensors) != 4 * num_layers:
            raise ValueError(
                f"A cache of {num_layers} layers is {4 * num_layers} tensors; got {len(tensors)}."
            )
        return cls(*(tuple(tensors[k * num_layers : (k + 1) * num_layers]) for k in range(4)))

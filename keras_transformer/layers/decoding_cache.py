"""The key/value cache of incremental decoding (§3.2.3 at inference), as named tensors.

Shape legend: rows = sentences x beams (the beams of a sentence consecutive),
sentences, len_cache (self-attention positions), len_src, num_heads,
depth = d_model / num_heads. Every tensor is heads-first, as the attention
products read it (no transpose per step).

Two policies for the self-attention half, behind the same decoding step
(`Transformer.decode_step`):
- **growing** (`init_cache(memory)`): it starts with 0 positions and every
  step appends one (`len_cache` = positions decoded so far), so a step reads
  only the filled positions. Its shape changes every step: eager, `tf.function`
  (a `tf.while_loop` with relaxed shape invariants), exported graphs.
- **fixed** (`init_cache(memory, max_length)`): `max_length` preallocated
  positions, one written per step and the rest masked. Static shapes: XLA, JAX.

The cross-attention half is the memory projected once per sentence (not per
beam). `Transformer.init_cache` makes a cache; `Transformer.decode_step`
returns it with the step's keys and values added; beam search `reorder`s the
rows by beam origin and `select_sentences` drops finished sentences; export
flattens it (`flat` / `from_flat`) into graph inputs and outputs.
"""

from typing import NamedTuple

from keras_transformer.layers.portable_ops import gather_rows


class LayerCache(NamedTuple):
    """One decoder layer's cache: self-attention `(rows, num_heads, len_cache, depth)`
    (positions decoded so far; a fixed-size cache has zeros after them) and
    cross-attention `(sentences, num_heads, len_src, depth)` (the memory projected once)."""

    self_key: object
    self_value: object
    cross_key: object
    cross_value: object


class CacheHistory(NamedTuple):
    """How the rows of a beam search read a fixed-size self-attention cache that is never
    reordered (`keras_transformer.decoding.search`): each row writes its step's keys and
    values into its own cache row, in place, and reads each earlier position from the row
    that wrote it.

    rows: int `(rows, len_cache)`, the cache row holding each position of each row's
        hypothesis (positions not written yet: any row in range; the mask hides them).
    block: None, or a Python int: a step before position `block` reads the first `block`
        positions only (most outputs are shorter than the cache, sized for the longest
        allowed).
    """

    rows: object
    block: object = None


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
        """The self-attention caches gathered by row: `indices` `(new_rows,)` are the rows the
        new beams extend (one gather per tensor; rows left out are dropped). The
        cross-attention ones are per sentence and stay."""
        return self.with_self_attention(
            [gather_rows(t, indices) for t in self.self_key],
            [gather_rows(t, indices) for t in self.self_value],
        )

    def select_sentences(self, indices):
        """The cross-attention caches of the sentences `indices` `(new_sentences,)` only
        (finished sentences leave the batch; the self-attention rows go with `reorder`)."""
        return self._replace(
            cross_key=tuple(gather_rows(t, indices) for t in self.cross_key),
            cross_value=tuple(gather_rows(t, indices) for t in self.cross_value),
        )

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

"""Several trained Transformers searched as one: an ensemble.

At every decoding step the next token's distribution is the members' mean,
p(y | ...) = (1/n) sum_i p_i(y | ...), the rule of fairseq's and Marian's
ensembles (the paper's §6.1 beam search then runs on it unchanged). The
members share one vocabulary and its special ids (train the later members
with `train --tokenizer FIRST/tokenizer.model`), the attention's `num_heads`
and `d_model` and `max_length`; their depths, feed-forward widths and weights
may differ.

`Ensemble` has the methods the searches call on a `Transformer` (`encode`,
`init_cache`, `decode_step`, `decoder_output`, `project`, a call on
`{"source_ids", "target_ids"}`), so greedy, beam search, sampling and every
decoding control run on it as they do on one model (`keras_transformer.decoding`);
the controls see the mean's log-probabilities (`repetition_penalty` scales those).
Its tensors are the members' side by side:
- memory `(batch, len_src, n * d_model)`: member i's is `[..., i * d_model : (i + 1) * d_model]`;
- the `DecodingCache`: each field is the members' per-layer tuples one after another
  (member 0's layers, then member 1's, ...), so the search's reorder, sentence
  selection and fixed-cache writes treat it as one cache;
- "logits" `(rows, vocab)`: log of the mean probability, already normalized (a
  log-softmax of them returns them).

`keras-transformer export --model A B` writes an ensemble's SavedModel and ONNX graphs
(their searches run on all members); CTranslate2 has no ensembles.
"""

import math

from keras import ops

from keras_transformer.layers.decoding_cache import DecodingCache
from keras_transformer.utils.checks import UserError

# What the members must share: the vocabulary and its ids, positions, and the cache's layout.
SHARED_CONFIG = (
    "vocab_size",
    "target_vocab",
    "pad_id",
    "bos_id",
    "eos_id",
    "max_length",
    "d_model",
    "num_heads",
)


def ensemble_mismatch(configs, names):
    """A one-line reason why models of `configs` (named `names`) cannot be one ensemble, or None."""
    first = configs[0]
    for config, name in zip(configs[1:], names[1:]):
        for field in SHARED_CONFIG:
            if getattr(config, field) != getattr(first, field):
                return (
                    f"{name} has {field} {getattr(config, field)} and {names[0]} "
                    f"{getattr(first, field)}: an ensemble's members share {', '.join(SHARED_CONFIG)}."
                )
    return None


class Ensemble:
    """The members' mean next-token distribution, decoded as one model (module docstring).

    Args:
        members: two or more `Transformer`s (`SHARED_CONFIG` equal).
        names: what a refusal calls each member (default `model 0`, `model 1`, ...; the CLI: its paths).
    """

    def __init__(self, members, names=None):
        members = list(members)
        if len(members) < 2:
            raise UserError(f"An ensemble needs two or more models; got {len(members)}.")
        names = [f"model {i}" for i in range(len(members))] if names is None else [str(n) for n in names]
        problem = ensemble_mismatch([m.config for m in members], names)
        if problem:
            raise UserError(problem)
        self.members = members
        self.config = members[0].config
        self._width = self.config.d_model
        self._layers = [m.config.num_decoder_layers for m in members]

    def __len__(self):
        return len(self.members)

    def __call__(self, inputs, training=False):
        """Teacher-forced `(batch, len_tgt, vocab)` log of the members' mean probabilities."""
        return self._mean([member(inputs, training=training) for member in self.members])

    def encode(self, source_ids, training=False):
        """`(batch, len_src)` -> the members' memories side by side `(batch, len_src, n * d_model)`."""
        return ops.concatenate(
            [ops.cast(m.encode(source_ids, training=training), "float32") for m in self.members], axis=-1
        )

    def _memories(self, memory):
        return [memory[..., i * self._width : (i + 1) * self._width] for i in range(len(self.members))]

    def _caches(self, cache):
        """The joint `DecodingCache` -> each member's."""
        caches, start = [], 0
        for layers in self._layers:
            caches.append(DecodingCache(*(field[start : start + layers] for field in cache)))
            start += layers
        return caches

    @staticmethod
    def _joined(caches):
        return DecodingCache(*(sum((tuple(field) for field in fields), ()) for fields in zip(*caches)))

    @staticmethod
    def _mean(logits):
        """The members' logits `(..., vocab)` -> log of their mean probability (float32).

        log((1/n) sum_i p_i) = (log(sum_i exp(lp_i - top)) + top) - log(n), with lp_i the
        members' log-softmaxes and top their elementwise maximum: `ops.logsumexp` over the
        members stacked, in the same order of operations (bit for bit the same on the
        TensorFlow backend, for finite logits, which a `Transformer`'s projection gives:
        tests/test_ensemble.py), without the stacked copy and the guards for an infinite
        maximum that TensorFlow's `reduce_logsumexp` adds: in an exported decoder step those
        were about half of the mean's ~20 nodes over the `(rows, vocab)` tensor.
        """
        log_probs = [ops.log_softmax(ops.cast(x, "float32"), axis=-1) for x in logits]
        top = log_probs[0]
        for member in log_probs[1:]:
            top = ops.maximum(top, member)
        total = ops.exp(log_probs[0] - top)
        for member in log_probs[1:]:
            total = total + ops.exp(member - top)
        return (ops.log(total) + top) - math.log(len(logits))

    def init_cache(self, memory, max_length=None, beam_size=1):
        """`Transformer.init_cache` of each member on its part of `memory`, joined."""
        return self._joined(
            [
                member.init_cache(ops.cast(part, member.compute_dtype), max_length, beam_size)
                for member, part in zip(self.members, self._memories(memory))
            ]
        )

    def step_projection_kernel(self):
        """Each member's `Transformer.step_projection_kernel` (a tuple), None if none has one."""
        kernels = tuple(member.step_projection_kernel() for member in self.members)
        return None if all(k is None for k in kernels) else kernels

    def decode_step(self, token_ids, step, cache, memory_mask, cache_history=None, projection_kernel=None):
        """`Transformer.decode_step` of every member on its part of the cache; the logits are
        the log of the members' mean probability `(rows, vocab)`."""
        kernels = projection_kernel or (None,) * len(self.members)
        logits, caches = [], []
        for member, part, kernel in zip(self.members, self._caches(cache), kernels):
            member_logits, member_cache = member.decode_step(
                token_ids, step, part, memory_mask, cache_history=cache_history, projection_kernel=kernel
            )
            logits.append(member_logits)
            caches.append(member_cache)
        return self._mean(logits), self._joined(caches)

    def decoder_output(self, target_ids, memory, source_mask, training):
        """The members' last decoder outputs side by side `(batch, len_tgt, n * d_model)`."""
        outputs = [
            m.decoder_output(target_ids, ops.cast(part, m.compute_dtype), source_mask, training)
            for m, part in zip(self.members, self._memories(memory))
        ]
        return ops.concatenate([ops.cast(output, "float32") for output in outputs], axis=-1)

    def project(self, hidden):
        """`decoder_output`'s joint output -> log of the members' mean probability."""
        return self._mean(
            [
                m.project(ops.cast(part, m.compute_dtype))
                for m, part in zip(self.members, self._memories(hidden))
            ]
        )

"""Random sampling that gives the same tokens in every runtime, written once.

TensorFlow's, ONNX Runtime's and NumPy's random generators differ, so the
randomness comes from none of them: every (seed, sentence index in the
request, sample index, step, token id) is hashed to a uniform number with
integer arithmetic every runtime has (int64 add, multiply, floor division and
modulo, kept below 2^63; no XOR, which ONNX opset 17 lacks: `_mix`), and the token is
chosen by the Gumbel-max rule

    token = argmax over the allowed set of  log_probs / T - log(-log(u_token))

which samples from `softmax(log_probs / T)` restricted to that set. Keyed by
the sentence's index in the request and not by its row, a sample does not
depend on which other sentences share its batch, nor on `num_return` (sample
k of a sentence is the same whether 1 or 8 were asked for).

The allowed set (as CTranslate2 and Hugging Face define them): the tokens the
rules allow (`policy.constrain`, `controls`), then the `topk` likeliest of them
(0: all), then the smallest prefix of those, by probability, whose probability
under `softmax(log_probs / T)` restricted to the top-k reaches `topp`.

What is guaranteed: identical tokens wherever the runtimes' log-probabilities
are identical, as for beam search; the float32 `log`, `exp` and cumulative sums
may differ in the last bit between runtimes, which can flip a choice only
between two values that close. The score of a sample is the model's
log-probability of it (not tempered), so samples and beam outputs compare.

Shape legend: rows = sentences x samples, vocab.
"""

from keras_transformer.decoding.policy import NEG_INF

_MODULUS = 2**31
_MULTIPLIER, _INCREMENT = 1103515245, 12345  # an affine bijection of [0, 2^31)
# Round constants of `_mix` (any values below 2^31: fractional digits of square roots).
_ROUNDS = (0x2545F491, 0x6A09E667, 0x3C6EF372)


def _mix(value):
    """A 31-bit integer hash (int64 array in [0, 2^31) -> the same): an affine map, then three
    rounds of a middle square `x = (x^2 + c) // 2^15 + x` and an affine map (mod 2^31; every
    product stays below 2^63). Measured on NumPy (tests/test_sampling.py): uniform, and
    independent between neighbouring tokens, sentences, samples, steps and seeds."""
    value = (value * _MULTIPLIER + _INCREMENT) % _MODULUS
    for constant in _ROUNDS:
        value = ((value * value + constant) // 32768 + value) % _MODULUS
        value = (value * _MULTIPLIER + constant) % _MODULUS
    return value


def row_keys(seed, sentence_ids, sample_ids, step, xp):
    """int64 `(rows,)`: the hash of (seed, sentence index in the request, sample index, step).

    The seed (0 to 2^63 - 1) is hashed in 31-bit parts, low first: a seed below 2^31 has only
    the first (its keys as before the other parts existed), and seeds that differ above bit 31
    differ (they once shared their low part's samples), with no sum past int64 in any runtime."""
    seed = _as_int64(seed, xp)
    middle, top = (seed // _MODULUS) % _MODULUS, seed // (_MODULUS * _MODULUS)
    key = _mix((seed % _MODULUS + 0x2545F491) % _MODULUS)
    wide = _mix((_mix((key + middle) % _MODULUS) + top) % _MODULUS)
    # (Not `seed > 2^31 - 1`: tf2onnx's `Greater` on int64 compares in float32, where 2^31 + 5
    # and 2^31 - 1 are equal.)
    key = xp.where(xp.greater(middle + top, 0), wide, key)
    for part in (sentence_ids, sample_ids, step):
        key = _mix((key + _as_int64(part, xp)) % _MODULUS)
    return key


# The largest float32 below 1 (1 - 2^-24): the top of `uniform`'s range.
_BELOW_ONE = 1.0 - 2.0**-24


def uniform(keys, vocab, xp):
    """float32 `(rows, vocab)` in (0, 1): `(k + 0.5) / 2^24` for a 24-bit `k` of the hash,
    at most `_BELOW_ONE`.

    Below 1/2 these are exact; above it float32 rounds `k + 0.5` to an even integer (each
    value then stands for two `k`s, still uniform), and the top one, `k = 2^24 - 1`, to 2^24:
    u = 1 made the Gumbel noise `-log(-log(u))` +inf, so that token was sampled whatever its
    probability (for a vocabulary of 8000 about once in 2,100 steps of a row, e.g. seed 7,
    sentence 19, first step, token 4387) and NumPy warned of a log of zero. The cap gives it
    the noise of the top 2^-24 of the distribution instead (16.6), as every runtime computes
    it."""
    hashed = _mix((keys[:, None] + _as_int64(xp.arange(vocab), xp)[None, :]) % _MODULUS)
    return xp.minimum((_as_float32(hashed // 128, xp) + 0.5) / 16777216.0, _BELOW_ONE)


def allowed(scaled, topk, topp, xp):
    """bool `(rows, vocab)`: the sampling set of `scaled` = log_probs / T `(rows, vocab)` (banned
    tokens at `NEG_INF / T`): the top-k, then the top-p of those (at least one token). Only the
    top-k are sorted (the whole vocabulary for top-p alone), and nothing without a limit."""
    vocab = scaled.shape[-1]
    k = xp.where(xp.logical_or(xp.less_equal(topk, 0), xp.greater(topk, vocab)), vocab, topk)

    def restricted():
        ordered = _descending(scaled, k, xp)  # (rows, k), largest first
        weights = xp.exp(ordered - ordered[:, :1])
        cumulative = xp.cumsum(weights, axis=-1)
        below = xp.less(cumulative, topp * cumulative[:, -1:])  # mass before reaching p
        kept = 1 + xp.sum(_as_int32(below, xp), axis=-1)  # (rows,) tokens kept, <= k
        threshold = xp.take_along_axis(ordered, xp.reshape(kept - 1, (-1, 1)), axis=-1)  # (rows, 1)
        return xp.greater_equal(scaled, threshold)

    def everything():
        return xp.greater(scaled, 3 * NEG_INF)  # all True: the banned ones are left out by `sample`

    limited = xp.logical_or(xp.less(k, vocab), xp.less(topp, 1.0))
    if xp.__name__ == "numpy":
        return restricted() if limited else everything()
    from keras_transformer.decoding.search import when

    return when(limited if isinstance(limited, bool) else limited, restricted, everything)


def sample(log_probs, keys, topk, topp, temperature, xp):
    """int32 `(rows,)`: one token per row from `softmax(log_probs / temperature)` restricted to
    the allowed set (module docstring); `log_probs` `(rows, vocab)` after the rules, `keys`
    `row_keys` `(rows,)`."""
    scaled = log_probs / temperature
    candidates = xp.logical_and(allowed(scaled, topk, topp, xp), xp.greater(log_probs, NEG_INF / 2))
    gumbel = -xp.log(-xp.log(uniform(keys, log_probs.shape[-1], xp)))
    return _argmax(xp.where(candidates, scaled + gumbel, 3 * NEG_INF), xp)


def _argmax(values, xp):
    """int32 index of each row's largest value (the first on ties)."""
    if xp.__name__ == "numpy":
        return xp.argmax(values, axis=-1).astype("int32")
    from keras_transformer.layers.portable_ops import argmax

    return argmax(values)


def _descending(values, count, xp):
    """The `count` largest of each row, largest first."""
    if xp.__name__ == "numpy":
        return -xp.sort(-values, axis=-1)[:, : int(count)]
    return xp.top_k(values, k=count)[0]


def _as_int64(value, xp):
    return xp.asarray(value).astype("int64") if xp.__name__ == "numpy" else xp.cast(value, "int64")


def _as_int32(value, xp):
    return xp.asarray(value).astype("int32") if xp.__name__ == "numpy" else xp.cast(value, "int32")


def _as_float32(value, xp):
    return xp.asarray(value).astype("float32") if xp.__name__ == "numpy" else xp.cast(value, "float32")

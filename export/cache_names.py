"""The graph input and output names of the decoding cache, defined once for every
exporter and runtime (no TensorFlow import: ONNX Runtime serving reads them too)."""

# The graph names of a `DecodingCache`'s fields, defined here only: `decoder_step`
# takes `past_key_i, past_value_i, cross_key_i, cross_value_i` (`DecodingCache.flat`
# order) and returns `present_key_i, present_value_i`; `encode` returns `cross_*_i`.
CACHE_INPUTS = ("past_key", "past_value", "cross_key", "cross_value")
CACHE_OUTPUTS = ("present_key", "present_value")


def _names(kinds, num_layers):
    return [f"{kind}_{i}" for kind in kinds for i in range(num_layers)]


def cache_input_names(num_layers):
    """`decoder_step`'s cache inputs, in `DecodingCache.flat` order."""
    return _names(CACHE_INPUTS, num_layers)


def past_names(num_layers):
    """The self-attention cache inputs (`past_key_i`, then `past_value_i`)."""
    return _names(CACHE_INPUTS[:2], num_layers)


def cross_names(num_layers):
    """The cross-attention cache (`encode`'s outputs, `decoder_step`'s inputs)."""
    return _names(CACHE_INPUTS[2:], num_layers)


def present_names(num_layers):
    """`decoder_step`'s updated self-attention caches, matching `past_names`."""
    return _names(CACHE_OUTPUTS, num_layers)


def cache_layers(config):
    """The decoder layers of an export's cache from `export.json`'s `model` config: an ensemble's
    (`ensemble`: every member's config) its members' layers one after another, else the model's."""
    return sum(m["num_decoder_layers"] or m["num_layers"] for m in config.get("ensemble", [config]))

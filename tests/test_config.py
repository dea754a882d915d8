import pytest

import keras_transformer as kt


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(d_model=100, num_heads=8), "d_model=100 must be divisible by num_heads=8"),
        (dict(attention_mode="fused"), "attention_mode must be one of ['batched', 'per_head']"),
        (dict(num_layers=0), "num_layers must be a positive integer"),
        (dict(d_ff=-1), "d_ff must be a positive integer"),
        (dict(vocab_size=0), "vocab_size must be a positive integer"),
        (dict(max_length=0), "max_length must be a positive integer"),
        (dict(dropout_rate=1.0), "dropout_rate must be a number in [0, 1)"),
        (dict(target_vocab_size=50), "share_embeddings=True needs one vocabulary"),
        (dict(eos_id=1000), "eos_id must be an id in [0, 100)"),
    ],
)
def test_bad_configuration_raises_value_error_naming_the_argument(overrides, message):
    with pytest.raises(ValueError) as error:
        kt.TransformerConfig.from_preset("tiny", **{"vocab_size": 100, **overrides})
    assert message in str(error.value)


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ValueError) as error:
        kt.Transformer.from_preset("huge", vocab_size=100)
    assert "preset must be one of ['base', 'big', 'small', 'mini', 'tiny']" in str(error.value)


def test_preset_without_vocab_size_says_so():
    with pytest.raises(ValueError, match="needs vocab_size"):
        kt.TransformerConfig.from_preset("base")


def test_presets_follow_table_3():
    base = kt.TransformerConfig.from_preset("base", vocab_size=37000)
    big = kt.TransformerConfig.from_preset("big", vocab_size=37000)
    assert (base.num_layers, base.d_model, base.d_ff, base.num_heads, base.dropout_rate) == (
        6,
        512,
        2048,
        8,
        0.1,
    )
    assert (big.num_layers, big.d_model, big.d_ff, big.num_heads, big.dropout_rate) == (
        6,
        1024,
        4096,
        16,
        0.3,
    )
    assert base.layer_norm_epsilon == 1e-6 and not base.norm_first


@pytest.mark.parametrize("preset, expected", [("base", 63.08e6), ("big", 214.25e6)])
def test_parameter_counts_match_table_3_with_biases(preset, expected):
    # Table 3 rounds to 65M / 213M; the exact counts with a shared 37k
    # vocabulary are 63,082,496 and 214,245,376 (README, "Parameter counts").
    count = kt.Transformer.from_preset(preset, vocab_size=37000).count_params()
    assert abs(count - expected) <= 0.002 * expected


def test_untied_embeddings_add_the_expected_parameters():
    tied = kt.Transformer.from_preset("tiny", vocab_size=100).count_params()
    untied = kt.Transformer.from_preset(
        "tiny", vocab_size=100, share_embeddings=False, tie_output=False
    ).count_params()
    assert untied - tied == 100 * 64 + (64 * 100 + 100)  # target embedding + Dense(vocab)

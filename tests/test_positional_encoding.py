import math

import numpy as np

import keras_transformer as kt


def test_table_equals_the_paper_formula_at_hand_computed_positions():
    d_model = 512
    table = kt.sinusoidal_table(100, d_model)
    # PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d))
    hand = {
        (0, 0): 0.0,
        (0, 1): 1.0,
        (1, 0): math.sin(1.0),
        (1, 1): math.cos(1.0),
        (7, 10): math.sin(7 / 10000 ** (10 / 512)),
        (7, 11): math.cos(7 / 10000 ** (10 / 512)),
        (99, 510): math.sin(99 / 10000 ** (510 / 512)),
        (99, 511): math.cos(99 / 10000 ** (510 / 512)),
        (50, 256): math.sin(50 / 100.0),  # 10000^(256/512) = 100
    }
    for (pos, dim), value in hand.items():
        assert abs(table[pos, dim] - value) < 1e-6, (pos, dim)


def test_sines_on_even_cosines_on_odd_not_concatenated():
    table = kt.sinusoidal_table(10, 8)
    np.testing.assert_allclose(table[:, 1], np.cos(np.arange(10)), atol=1e-6)
    np.testing.assert_allclose(table[:, 2], np.sin(np.arange(10) / 10000 ** (2 / 8)), atol=1e-6)


def test_layer_adds_table_from_offset():
    layer = kt.SinusoidalPositionalEncoding(max_length=20)
    inputs = np.ones((2, 3, 6), "float32")
    np.testing.assert_allclose(layer(inputs, offset=5)[1], 1.0 + kt.sinusoidal_table(20, 6)[5:8], atol=1e-6)

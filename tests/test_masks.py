import numpy as np

import keras_transformer as kt


def test_padding_mask_marks_real_tokens_as_keys():
    mask = kt.padding_mask(np.array([[7, 8, 0], [9, 0, 0]]), pad_id=0)
    assert mask.shape == (2, 1, 3)
    np.testing.assert_array_equal(mask[:, 0], [[True, True, False], [True, False, False]])


def test_causal_mask_is_lower_triangular():
    np.testing.assert_array_equal(kt.causal_mask(4)[0], np.tril(np.ones((4, 4), bool)))


def test_causal_mask_offset_is_a_row_of_the_full_mask():
    full = np.asarray(kt.causal_mask(5))[0]
    np.testing.assert_array_equal(kt.causal_mask(1, 5, offset=3)[0, 0], full[3])


def test_combine_masks_is_logical_and_and_skips_none():
    combined = kt.combine_masks(kt.causal_mask(3), None, kt.padding_mask(np.array([[1, 1, 0]])))
    expected = np.tril(np.ones((3, 3), bool)) & np.array([True, True, False])
    np.testing.assert_array_equal(combined[0], expected)
    assert kt.combine_masks(None, None) is None

"""scripts/bench_serving.py: every ratio is taken against CTranslate2 at its best thread setting."""

import pytest


@pytest.fixture(scope="module")
def bench(import_script):
    return import_script("bench_serving")


def test_rows_of_other_thread_settings_are_named_by_their_threads(bench):
    assert bench.ct2_native_name("int8", 2, default_threads=2) == "ct2_native_int8"
    assert bench.ct2_native_name("int8", 1, default_threads=2) == "ct2_native_int8 (1 thread)"
    assert bench.ct2_native_name("float32", 4, default_threads=2) == "ct2_native_float32 (4 threads)"


def test_the_baseline_of_each_figure_is_the_fastest_setting_at_that_precision(bench):
    """CTranslate2's int8 with 2 threads on 2 cores was 6x slower at batch 1 than with 1 (a
    smoke run of the benchmark): a ratio against it would flatter every int8 row of ours."""
    results = {
        "onnx_int8": {"batch1_warm_median_ms": 1.0, "batch32_seconds": 1.0},  # not a baseline
        "ct2_float32": {"batch1_warm_median_ms": 2.0, "batch32_seconds": 1.5},  # parity mode: not one
        "ct2_native_float32": {"batch1_warm_median_ms": 9.4, "batch32_seconds": 2.9},
        "ct2_native_float32 (1 thread)": {"batch1_warm_median_ms": 6.7, "batch32_seconds": 4.9},
        "ct2_native_int8": {"batch1_warm_median_ms": 25.7, "batch32_seconds": 6.6},
        "ct2_native_int8 (1 thread)": {"batch1_warm_median_ms": 4.3, "batch32_seconds": 3.5},
    }
    assert bench.ct2_best(results, "float32", "batch1_warm_median_ms") == "ct2_native_float32 (1 thread)"
    assert bench.ct2_best(results, "float32", "batch32_seconds") == "ct2_native_float32"
    assert bench.ct2_best(results, "int8", "batch1_warm_median_ms") == "ct2_native_int8 (1 thread)"
    assert bench.ct2_best(results, "int8", "batch32_seconds") == "ct2_native_int8 (1 thread)"

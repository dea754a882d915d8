"""`translate_lean.onnx` (`keras_transformer_export.lean_search`): the policy's rules emitted as ONNX
nodes compute what NumPy computes, the graph gives `translate.onnx`'s hypotheses on batches whose
sentences finish at different steps, and a request with a control goes to `translate.onnx`.
(Every decoding case against Keras: tests/test_decoding_controls_runtimes.py, runtime `onnx_lean`.)"""

import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import helper, numpy_helper

from keras_transformer.decoding import policy
from keras_transformer_export.lean_search import OnnxOps, Tensor, step_body, write_lean_graph
from keras_transformer_export.onnx_runtime import (
    DecodingOptions,
    FullGraphSearch,
    LeanGraphSearch,
    OnnxTranslator,
    make_session,
)


def _run(ops, inputs, outputs, feed):
    """The graph of `ops` with `inputs` `{name: (dtype, rank)}` and `outputs` `[Tensor]`, run on `feed`."""
    from keras_transformer_export.lean_search import _value

    graph = helper.make_graph(
        ops.nodes,
        "rules",
        [_value(name, dtype, [None] * rank if rank else []) for name, (dtype, rank) in inputs.items()],
        [_value(t.name, t.dtype, [None] * t.rank) for t in outputs],
        ops.initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feed)


@pytest.mark.parametrize("step", [0, 3, 6, 9])
@pytest.mark.parametrize("min_length", [0, 5])
def test_the_policy_rules_as_onnx_nodes_compute_what_numpy_computes(step, min_length):
    rng = np.random.default_rng(step + 10 * min_length)
    sentences, beam, vocab = 5, 3, 11
    logits = rng.normal(size=(sentences, beam, vocab)).astype(np.float32)
    log_probs = logits - np.log(np.sum(np.exp(logits), axis=-1, keepdims=True))
    limits = np.array([4, 7, 10, 1, 20], np.int32)
    never, is_eos = np.isin(np.arange(vocab), [0, 2]), np.arange(vocab) == 3
    alive = rng.normal(size=(sentences, beam)).astype(np.float32) - 3
    finished = np.sort(rng.normal(size=(sentences, beam)).astype(np.float32) - 2, axis=1)[:, ::-1]
    alpha = np.float32(0.6)

    ops = OnnxOps("t/")
    names = {"log_probs": (np.float32, 3), "step": (np.int32, 0), "limits": (np.int32, 1),
             "min_length": (np.int32, 0), "alive": (np.float32, 2), "finished": (np.float32, 2),
             "alpha": (np.float32, 0), "early": (np.bool_, 0)}  # fmt: skip
    t = {name: Tensor(ops, name, dtype, rank) for name, (dtype, rank) in names.items()}
    constrained = policy.constrain(
        t["log_probs"], t["step"], t["limits"], never, is_eos, t["min_length"], ops
    )
    limits_float = ops.cast(t["limits"], np.float32)
    final = policy.search_is_final(
        ops.cast(t["step"], np.float32), limits_float, t["alive"], t["finished"], t["alpha"], ops
    )
    early_final = policy.search_is_final(
        ops.cast(t["step"], np.float32), limits_float, t["alive"], t["finished"], t["alpha"], ops, t["early"]
    )
    bounded = policy.output_limits(t["limits"], 16, ops, 3)
    feed = {"log_probs": log_probs, "step": np.array(step, np.int32), "limits": limits,
            "min_length": np.array(min_length, np.int32), "alive": alive, "finished": finished,
            "alpha": np.array(alpha)}  # fmt: skip
    for early in (False, True):
        got = _run(ops, names, [constrained, final, bounded, early_final], dict(feed, early=np.array(early)))
        want = [
            policy.constrain(log_probs, step, limits, never, is_eos, min_length, np),
            policy.search_is_final(np.float32(step), np.float32(limits), alive, finished, alpha, np),
            policy.output_limits(limits, 16, np, 3),
            policy.search_is_final(np.float32(step), np.float32(limits), alive, finished, alpha, np, early),
        ]
        for ours, theirs in zip(got, want):
            np.testing.assert_array_equal(ours, theirs)
        assert early or np.array_equal(got[3], got[1])
    assert not np.all(got[0] == log_probs)  # the rules did something


def test_constant_operands_are_folded_with_numpy():
    ops = OnnxOps("t/")
    never, is_eos, limits = np.array([True, False, False]), np.array([False, False, True]), np.array([3, 9])
    caps = policy.output_caps(np.int32(2), limits.astype(np.int32), never, is_eos, 0, 2, np.float32, ops)
    assert isinstance(caps, np.ndarray) and not ops.nodes and not ops.initializers
    np.testing.assert_array_equal(caps, policy.output_caps(2, limits, never, is_eos, 0, 2, np.float32, np))


@pytest.fixture(scope="module")
def onnx_dir(exported):
    return str(exported[1])


@pytest.fixture(scope="module")
def batch(onnx_dir, synthetic_files):
    """48 source sentences of every length in one padded batch (they finish at different steps, so
    the search goes through several stages), and one without content."""
    lines = synthetic_files[0].read_text(encoding="utf-8").splitlines()
    chosen = sorted(lines[:400], key=len)[::8][:48] + [" "]
    return OnnxTranslator(onnx_dir, "full").encode(chosen)


@pytest.mark.parametrize(
    "options",
    [
        {},
        dict(num_return=4),
        dict(length_penalty=1.1, max_extra_length=7),
        dict(early_stopping=True, num_return=4),
    ],
)
def test_lean_graph_gives_translate_onnx_hypotheses_on_a_batch_with_stages(onnx_dir, batch, options):
    request = DecodingOptions(**options)
    full = FullGraphSearch(onnx_dir).search(batch, request)
    lean = LeanGraphSearch(onnx_dir).search(batch, request)
    np.testing.assert_array_equal(lean.ids, full.ids)
    np.testing.assert_allclose(lean.scores, full.scores, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lean.log_probs, full.log_probs, rtol=1e-5, atol=1e-5)
    assert lean.ids.shape[1] == request.num_return
    assert np.all(lean.ids[-1, :, 0] == 3) and np.all(lean.scores[-1] == 0)  # the empty source: EOS alone


def test_requests_with_a_control_are_searched_by_translate_onnx(onnx_dir, batch, monkeypatch):
    plain = LeanGraphSearch.plain
    assert plain(DecodingOptions(num_return=2, min_length=3, length_penalty=1.0, max_extra_length=5))
    for changes in (dict(disable_unk=True), dict(no_repeat_ngram_size=2), dict(repetition_penalty=1.2),
                    dict(sampling_topk=5), dict(return_alignments=True)):  # fmt: skip
        assert not plain(DecodingOptions(**changes)), changes
    assert not plain(DecodingOptions(), target_prefix=[[], [5, 6]])
    assert plain(DecodingOptions(), target_prefix=[[], []], suppress_sequences=[])
    assert not plain(DecodingOptions(), suppress_sequences=[[7]])

    search = LeanGraphSearch(onnx_dir)
    calls = []
    monkeypatch.setattr(search.full, "search", lambda *a, **k: calls.append(a) or "full")
    assert search.search(batch[:2], DecodingOptions(no_repeat_ngram_size=2)) == "full"
    assert search.search(batch[:2], DecodingOptions()) != "full" and len(calls) == 1


def test_fewer_nodes_per_step_than_translate_onnx(onnx_dir, import_script):
    main_body = import_script("count_loop_nodes").main_body
    lean = step_body(onnx.load(os.path.join(onnx_dir, "translate_lean.onnx")))
    decoder = onnx.load(os.path.join(onnx_dir, "decoder_step.onnx")).graph
    full = main_body(onnx.load(os.path.join(onnx_dir, "translate.onnx")))
    search_nodes = sum(node.name.startswith("lean/step/") for node in lean.node)
    assert search_nodes <= 90, search_nodes  # the search's own nodes per step
    assert len(lean.node) - search_nodes <= len(decoder.node)
    assert len(lean.node) < len(full.node) - 100, (len(lean.node), len(full.node))


def test_the_step_runs_no_node_that_is_the_same_at_every_step(onnx_dir):
    """A node of `decoder_step.onnx` that reads only the stage's values (the source mask, the
    cross-attention keys and values) and constants runs once per stage, before the steps' `Loop`
    (in the portable step: the source mask's expansion for the attention logits, the transposed
    cross-attention keys, the shapes they are reshaped to)."""
    model = onnx.load(os.path.join(onnx_dir, "translate_lean.onnx"))
    stages = next(node for node in model.graph.node if node.op_type == "Loop")
    stage = next(a.g for a in stages.attribute if a.name == "body")
    body = step_body(model)
    made = {name for node in body.node for name in node.output} | {value.name for value in body.input}
    constants = {init.name for init in body.initializer}
    outer = {name for node in body.node for name in node.input if name and name not in made | constants}
    assert any(name.startswith("dec/") for name in outer)  # what the stage computed for the steps
    invariant = set(outer)
    for node in body.node:
        assert not all(name in invariant or name in constants for name in node.input if name), node.name
    hoisted = [node for node in stage.node if node.name.startswith("dec/")]
    assert hoisted and all(node.op_type != "Loop" for node in hoisted)


def test_the_graph_is_rebuilt_identically_from_an_export_directory(onnx_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(onnx_dir, copy)
    os.remove(copy / "translate_lean.onnx")
    write_lean_graph(str(copy))
    rebuilt = (copy / "translate_lean.onnx").read_bytes()
    assert rebuilt == Path(onnx_dir, "translate_lean.onnx").read_bytes()
    make_session(str(copy / "translate_lean.onnx"))  # ONNX Runtime loads it


def test_the_exports_options_are_the_graphs_defaults(onnx_dir, batch, tmp_path):
    """`export --early-stopping` (an option in `export.json`) is what a request without it gets; an
    export made before the option existed gets the option's default."""
    import json

    for early in (True, None):
        copy = tmp_path / f"copy-{early}"
        shutil.copytree(onnx_dir, copy)
        metadata = json.loads((copy / "export.json").read_text())
        if early is None:
            del metadata["decoding"]["early_stopping"]
        else:
            metadata["decoding"]["early_stopping"] = early
        (copy / "export.json").write_text(json.dumps(metadata))
        write_lean_graph(str(copy))
        graph = onnx.load(str(copy / "translate_lean.onnx")).graph
        default = next(i for i in graph.initializer if i.name == "early_stopping")
        assert bool(numpy_helper.to_array(default)) == bool(early)
        session = make_session(str(copy / "translate_lean.onnx"))
        names = [o.name for o in session.get_outputs()]
        alone = dict(zip(names, session.run(None, {"source_ids": batch})))
        asked = LeanGraphSearch(onnx_dir).search(batch, DecodingOptions(early_stopping=bool(early)))
        np.testing.assert_array_equal(alone["target_ids"], asked.ids[:, 0])


def test_an_export_without_the_lean_graph_says_what_to_do(onnx_dir, tmp_path):
    copy = tmp_path / "old"
    shutil.copytree(onnx_dir, copy)
    os.remove(copy / "translate_lean.onnx")
    with pytest.raises(FileNotFoundError, match="export the model again, or use mode='full'"):
        OnnxTranslator(str(copy), "lean")


def test_prefixed_graph_names_unnamed_nodes_apart_from_named_ones():
    """tf2onnx names nodes `Reshape_16` too: an unnamed node at index 16 must not get that name
    (ONNX Runtime refused the fused int8 `translate_lean.onnx` of the `mini` model so: "two nodes
    with same node name (enc/Reshape_16)")."""
    from keras_transformer_export.graph_rewrites import prefixed_graph

    nodes = [
        helper.make_node("Identity", ["x"], ["a"], name="Identity_1"),
        helper.make_node("Identity", ["a"], ["b"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT, [1])],
    )
    names = [node.name for node in prefixed_graph(graph, "p/", {}).node]
    assert names[0] == "p/Identity_1" and len(set(names)) == 2 and all(n.startswith("p/") for n in names)


@pytest.mark.parametrize("rank", [2, 3])
def test_output_cap_rows_hold_output_caps_of_every_state(rank):
    """`take(output_cap_rows, output_cap_row)` (the lean graph's caps, one row `Gather`) equals
    `output_caps` for sentences plain, before `min_length`, at their last step (which wins);
    so does the row of a table of rows per step (what the lean graph computes once a stage)."""
    never, is_eos = np.isin(np.arange(9), [0, 3]), np.arange(9) == 2
    rows = policy.output_cap_rows(never, is_eos, rank, np.float32)
    limits = np.array([1, 2, 4, 9, 9], np.int32)
    for min_length in (0, 1, 3, 6):
        by_step = policy.output_cap_row(np.arange(9)[:, None], limits, min_length, np)  # (steps, sentences)
        for step in range(9):
            want = policy.output_caps(np.int32(step), limits, never, is_eos, min_length, rank, np.float32, np)
            got = np.take(rows, policy.output_cap_row(np.int32(step), limits, min_length, np), axis=0)
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(np.take(rows, by_step[step], axis=0), want)


@pytest.mark.parametrize("vocab", [300, 8000, 101])  # chunks of 15, of 80, none (a prime)
@pytest.mark.parametrize("seed, step", [(0, 4), (1, 7)])  # before min_length; after it
def test_top_candidates_by_chunks_are_the_top_k_of_all_constrained_candidates(vocab, seed, step):
    """`_top_candidates` ranks chunks first and caps only the chunks that hold a special id id
    by id: the same values and flat indices, in the same order, as one `TopK` over all `beam *
    vocab` candidates of `policy.constrain`'s log-probabilities (value descending, ties to the
    lower index), with many ties (values from a coarse grid), sentences in each of the caps'
    states (before `min_length`, at the last step), and dead beams."""
    from keras_transformer_export.lean_search import _ChunkCaps, _top_candidates, chunk_size

    rng = np.random.default_rng(seed)
    sentences, beam, eos = 6, 4, 3
    log_probs = (-rng.integers(0, 12, size=(sentences * beam, vocab)) / 4).astype(np.float32)
    alive = (-rng.integers(0, 3, size=(sentences, beam)) / 2).astype(np.float32)
    alive[2, 1:] = policy.NEG_INF  # the first step: one live beam
    alive[3, 2] = policy.NEG_INF  # a beam whose hypothesis finished
    alive[4] = alive[4, 0]  # every beam equal: ties across beams
    ids = np.arange(vocab)
    never, is_eos = np.isin(ids, [0, 2]), ids == eos
    min_length = 6
    limits = np.array([20, 5, 20, 20, 9, 20], np.int32)  # sentence 1 at its last step
    caps = _ChunkCaps(policy.output_cap_rows(never, is_eos, 2, np.float32), chunk_size(vocab))
    states = policy.output_cap_row(step, limits, min_length, np)
    assert set(states.tolist()) == {1 if step < min_length - 1 else 0, 2}  # and one at its last step

    ops = OnnxOps("t/")
    t = {"log_probs": Tensor(ops, "log_probs", np.float32, 2), "alive": Tensor(ops, "alive", np.float32, 2)}
    index = ops.const((states * caps.chunks)[:, None], np.int64)
    starts = ops.const((np.arange(sentences) * beam * caps.chunks)[:, None], np.int64)
    values, flat = _top_candidates(ops, t["log_probs"], t["alive"], beam, caps, index, starts)
    names = {"log_probs": (np.float32, 2), "alive": (np.float32, 2)}
    got_values, got_index = _run(ops, names, [values, flat], {"log_probs": log_probs, "alive": alive})

    constrained = policy.constrain(
        log_probs.reshape(sentences, beam, vocab), step, limits, never, is_eos, min_length, np
    )
    candidates = (alive[:, :, None] + constrained).reshape(sentences, -1)
    order = np.arange(beam * vocab)
    want_index = np.stack([np.lexsort((order, -row))[:beam] for row in candidates])
    np.testing.assert_array_equal(got_index, want_index)
    np.testing.assert_array_equal(got_values, np.take_along_axis(candidates, want_index, axis=1))
    assert (caps.chunks == 1) == (vocab == 101)

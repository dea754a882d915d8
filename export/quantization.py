"""Int8 ONNX graphs (ONNX Runtime dynamic quantization), gated on validation BLEU.

`quantize_int8` applies `onnxruntime.quantization.quantize_dynamic` to the
matrix products with a constant weight: every `MatMul` of the encoder, of the
decoder (inside the beam search's `Loop` too: `keras_transformer_export.graph_rewrites` first
makes its weights visible as initializers) and the output projection. Weights
become per-tensor symmetric int8; activations are quantized to uint8 on the fly
(`DynamicQuantizeLinear` + `MatMulInteger`). The attention products
(scores, weighted values) have no constant operand and stay float32, as do
LayerNorm, softmax and the embeddings.

Measured on the Multi30k recipe model (`mini`, val, beam 5, α 1.0): float32
35.29 sacreBLEU, int8 35.15 (−0.14), int8 with the output projection left in
float32 35.03 (−0.26): the projection is quantized too.

Int8 can hurt a model more than that (CTranslate2's int8 kept 70/100 identical
translations on a weakly trained model), so `export_onnx(...,
quantization="int8", gate=BleuGate(...))` translates the validation sentences
with the float32 and the int8 `translate.onnx` in ONNX Runtime and refuses to
write the int8 graphs when BLEU falls by more than `max_drop`
(`DEFAULT_MAX_BLEU_DROP`, 1.0) unless forced; the measurement goes into
`export.json` either way.
"""

import logging
import os
import tempfile
import time

from keras_transformer.utils.checks import UserError

DEFAULT_MAX_BLEU_DROP = 1.0


def quantize_int8(model):
    """An int8 copy of the ONNX `model` (a `ModelProto`): `MatMul`s with a constant weight, dynamic
    activations."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    # quantize_dynamic logs advice about static quantization's pre-processing on the root
    # logger; it does not apply to dynamic quantization of a converted graph.
    advice = logging.Filter()
    advice.filter = lambda record: "pre-processing before quantization" not in record.getMessage()
    root = logging.getLogger()
    root.addFilter(advice)
    try:
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "int8.onnx")
            quantize_dynamic(
                model,
                path,
                weight_type=QuantType.QInt8,
                op_types_to_quantize=["MatMul"],
                extra_options={"EnableSubgraph": True},
            )
            quantized = onnx.load(path)
    finally:
        root.removeFilter(advice)
    quantized.doc_string = model.doc_string + " (int8)"
    return quantized


def count_quantized(model):
    """`(MatMulInteger, float MatMul)` node counts over the model and its `Loop` bodies."""
    from keras_transformer_export.graph_rewrites import all_graphs

    types = [node.op_type for graph in all_graphs(model.graph) for node in graph.node]
    return types.count("MatMulInteger"), types.count("MatMul")


class QuantizationRefused(UserError):
    """Int8 lost more BLEU than allowed (one line for the CLI, exit 2)."""


class BleuGate:
    """Compares the float32 and int8 `translate.onnx` on validation pairs; refuses a large BLEU drop.

    Args:
        sources, references: the validation pairs (lists of str).
        target_lang: for sacreBLEU's tokenizer choice (`score_translations`).
        max_drop: the largest allowed fall in sacreBLEU, in BLEU points.
        force: write int8 even when the drop is larger (the report says so).
        threads: ONNX Runtime intra-op threads.

    Called as `gate(float_dir, int8_dir)` by `export_onnx`; returns the
    report for `export.json` or raises `QuantizationRefused`.
    """

    def __init__(
        self,
        sources,
        references,
        target_lang=None,
        max_drop=DEFAULT_MAX_BLEU_DROP,
        force=False,
        threads=None,
        log=None,
    ):
        if not sources or len(sources) != len(references):
            raise ValueError("BleuGate needs aligned, non-empty validation pairs.")
        if max_drop < 0:
            raise ValueError(f"max_drop must be >= 0; got {max_drop}.")
        self.sources, self.references = list(sources), list(references)
        self.target_lang, self.max_drop, self.force = target_lang, max_drop, force
        self.threads, self.log = threads, log

    def __call__(self, float_dir, int8_dir):
        from keras_transformer.evaluation import score_translations
        from keras_transformer_export.onnx_runtime import OnnxTranslator

        scores, texts, seconds = {}, {}, {}
        for name, directory in (("float32", float_dir), ("int8", int8_dir)):
            start = time.perf_counter()
            texts[name] = OnnxTranslator(directory, "full", batch_size=32, threads=self.threads).translate(
                self.sources
            )[0]
            seconds[name] = round(time.perf_counter() - start, 1)
            scores[name] = score_translations(texts[name], self.references, self.target_lang)
        drop = scores["float32"].bleu - scores["int8"].bleu
        report = {
            "sentences": len(self.sources),
            "bleu_float32": round(scores["float32"].bleu, 2),
            "bleu_int8": round(scores["int8"].bleu, 2),
            "bleu_drop": round(drop, 2),
            "max_bleu_drop": self.max_drop,
            "chrf_float32": round(scores["float32"].chrf, 2),
            "chrf_int8": round(scores["int8"].chrf, 2),
            "identical_translations": sum(a == b for a, b in zip(texts["float32"], texts["int8"])),
            "bleu_signature": scores["int8"].bleu_signature,
            "seconds": seconds,
            "passed": drop <= self.max_drop,
            "forced": bool(self.force and drop > self.max_drop),
        }
        if self.log is not None:
            self.log(
                f"int8 check on {len(self.sources)} validation pairs: BLEU {report['bleu_float32']} "
                f"(float32) -> {report['bleu_int8']} (int8), {report['identical_translations']} "
                f"identical translations"
            )
        if drop > self.max_drop and not self.force:
            raise QuantizationRefused(
                f"int8 loses {drop:.2f} BLEU on {len(self.sources)} validation pairs (float32 "
                f"{scores['float32'].bleu:.2f}, int8 {scores['int8'].bleu:.2f}), more than the allowed "
                f"{self.max_drop:g}; nothing written. Export float32, or pass --max-bleu-drop or --force."
            )
        return report

"""Deployment of keras_transformer models: TF Serving SavedModel, ONNX Runtime, CTranslate2.

- `export.graphs`: `TranslationGraphs`, the `tf.function`s every artifact is made of.
- `export.saved_model`: `export_saved_model`, TF Serving's versioned layout.
- `export.onnx`: `export_onnx`, the ONNX graphs (tf2onnx).
- `export.onnx_runtime`: `OnnxTranslator`, translation with ONNX Runtime only.
- `export.ctranslate2`: `export_ctranslate2` and `CTranslate2Translator` (needs ctranslate2).
- `export.parity`: `check_parity`, Keras == SavedModel == ONNX Runtime.
- `export.layout`: atomic version directories and `models.config`.

`keras-transformer export` (the CLI) uses them. This package imports the
library; the library never imports it.
"""

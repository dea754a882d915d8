"""Deployment of keras_transformer models: TF Serving SavedModel, ONNX Runtime, CTranslate2.

- `keras_transformer_export.graphs`: `TranslationGraphs`, the `tf.function`s every artifact is made of.
- `keras_transformer_export.saved_model`: `export_saved_model`, TF Serving's versioned layout.
- `keras_transformer_export.onnx`: `export_onnx`, the ONNX graphs (tf2onnx).
- `keras_transformer_export.onnx_runtime`: `OnnxTranslator`, translation with ONNX Runtime only.
- `keras_transformer_export.ctranslate2`: `export_ctranslate2`, `CTranslate2Translator`
  (needs ctranslate2).
- `keras_transformer_export.parity`: `check_parity`, Keras == SavedModel == ONNX Runtime.
- `keras_transformer_export.layout`: atomic version directories and `models.config`.

`keras-transformer export` (the CLI) uses them. This package imports the
library; the library never imports it.
"""

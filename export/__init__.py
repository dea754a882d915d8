"""Deployment of keras_transformer models: TF Serving SavedModel and ONNX Runtime.

Imports the library; the library never imports this package. The exporters
arrive with the deployment work (see README, "Roadmap").
"""

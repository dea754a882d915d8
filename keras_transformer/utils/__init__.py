"""Helpers every part of the package may use: argument checks and `UserError`,
atomic file writes, the private-Keras compatibility module, the TensorFlow import."""

"""The train step with the pre-softmax projection and the loss fused (TensorFlow backend).

`compile_transformer` installs it (`fused_step=True`, the default there);
`Transformer.train_step` runs it when installed and falls back to Keras' own
step on logits where it cannot fuse, saying why in the log once per trace.

What it saves: the logits path materialises `(batch, len_tgt, vocab)` float32
logits, most of them for padding. This step computes the label-smoothed loss
from the decoder output `(batch, len_tgt, d_model)` with the projection inside
the loss (`LabelSmoothedCrossEntropy.from_decoder_output`): only the real
target positions are projected; the loss, gradients and metrics are the
logits path's (tests/test_training.py).
"""

import logging

import keras

from keras_transformer.layers.masks import padding_mask
from keras_transformer.training.losses import LabelSmoothedCrossEntropy, MaskedTokenAccuracy
from keras_transformer.utils import keras_compat

LOG = logging.getLogger("keras_transformer")


class FusedOutputLossStep:
    """`step(model, data)` -> logs, or None where Keras' step must run (logged)."""

    def __init__(self):
        self.fallback_reason = None  # why the last traced step was not fused, or None

    def fusable_loss(self, model, sample_weight):
        """`(loss, None)` when the compiled set-up fuses, else `(None, why not)`.

        It fuses when `LabelSmoothedCrossEntropy` is the only loss (no loss
        weights) and reduces to a mean or sum, every compiled metric is a
        `MaskedTokenAccuracy` with its `pad_id` (the fused pass counts their
        correct tokens), no sample weights are given (Keras gives unweighted
        metrics none, the fused count has them), on the TensorFlow backend.
        """
        loss = getattr(model, "loss", None)
        compile_loss = keras_compat.compiled_loss(model)
        compile_metrics = keras_compat.compiled_metrics(model)
        if keras.backend.backend() != "tensorflow":
            return None, f"the fused step is TensorFlow-only (backend: {keras.backend.backend()})"
        if sample_weight is not None:
            return None, "sample weights are given"
        if not isinstance(loss, LabelSmoothedCrossEntropy) or compile_loss is None:
            return None, "the loss is not one LabelSmoothedCrossEntropy"
        if loss.reduction == "none":
            return None, "the loss has reduction='none'"
        if keras_compat.has_loss_weights(compile_loss):
            return None, "loss weights are given"
        if compile_metrics is not None:
            if not compile_metrics.built or keras_compat.has_weighted_metrics(compile_metrics):
                return None, "weighted metrics are compiled"
            if not all(
                isinstance(metric, MaskedTokenAccuracy) and metric.pad_id == loss.pad_id
                for metric in compile_metrics.metrics
            ):
                return None, "a compiled metric is not MaskedTokenAccuracy(pad_id)"
        return loss, None

    def __call__(self, model, data):
        import tensorflow as tf  # the TensorFlow backend: `fusable_loss` checked it

        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        compile_metrics = keras_compat.compiled_metrics(model)
        if compile_metrics is not None and not compile_metrics.built:
            # Without a strategy Keras builds them in the first traced
            # `update_state`, from the logits this step does not make.
            compile_metrics.build(y, keras.KerasTensor((None, None, model.config.target_vocab), "float32"))
        loss_function, self.fallback_reason = self.fusable_loss(model, sample_weight)
        if loss_function is None:
            LOG.warning("keras_transformer: train step on logits, not fused: %s.", self.fallback_reason)
            return None
        source_ids, target_ids = x["source_ids"], x["target_ids"]
        with tf.GradientTape() as tape:
            source_mask = padding_mask(source_ids, model.config.pad_id)
            memory = model.encoder(
                model.source_embedding(source_ids), attention_mask=source_mask, training=True
            )
            hidden = model.decoder_output(target_ids, memory, source_mask, training=True)
            kernel, bias = model.projection_weights()
            loss, correct, count = loss_function.from_decoder_output(y, hidden, kernel, bias)
            for extra in model.losses:  # what layers added (`add_loss`, regularizers), as `compute_loss`
                loss = loss + keras.ops.sum(keras.ops.cast(extra, loss.dtype))
            # As Keras' own step: the tracker shows the global mean under a strategy.
            replicas = tf.distribute.get_strategy().num_replicas_in_sync
            keras_compat.loss_tracker(model).update_state(
                loss * replicas, sample_weight=tf.shape(source_ids)[0]
            )
            loss = model.optimizer.scale_loss(loss)
        gradients = tape.gradient(loss, model.trainable_weights)
        model.optimizer.apply_gradients(zip(gradients, model.trainable_weights))
        for metric in compile_metrics.metrics if compile_metrics is not None else ():
            metric.update_counts(correct, count)
        return model.get_metrics_result()

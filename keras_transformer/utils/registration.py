"""The one serialization registration decorator of the package: every layer,
the model, the loss, the metric and the schedule are saved as
`keras_transformer>ClassName` (`keras_transformer.utils.lazy.register_when_keras_loads`
makes sure they are registered before Keras reads a `.keras` file)."""

import keras

register = keras.saving.register_keras_serializable(package="keras_transformer")

"""The private Keras names this package relies on, in one place, each with a test
(`tests/test_keras_compat.py`) so that a Keras upgrade that moves them fails
there and not in a user's run.

In-memory serialization: `model.save_weights` and `model.save` only take
paths, and HDF5 can crash the process (SIGSEGV) after a write to a full disk
fails. Serializing into memory keeps HDF5 away from the disk; the bytes are
then written by `files.atomic_write`, whose failures are ordinary `OSError`s.
The files are byte-for-byte what Keras writes (`model.load_weights` and
`keras.saving.load_model` read them).
"""

import io


def weights_bytes(model):
    """The `.weights.h5` file `model.save_weights` would write (model and optimizer), as bytes."""
    from keras.src.saving import saving_lib

    if not model.built:
        raise ValueError("Build the model before saving its weights.")
    buffer = io.BytesIO()
    store = saving_lib.H5IOStore(buffer, mode="w")
    try:
        saving_lib._save_state(
            model, weights_store=store, assets_store=None, inner_path="", visited_saveables=set()
        )
    finally:
        store.close()
    return buffer.getvalue()


def model_bytes(model):
    """The `.keras` file `model.save` would write, as bytes."""
    from keras.src.saving import saving_lib

    buffer = io.BytesIO()
    saving_lib.save_model(model, buffer)  # takes a file object; `keras.saving.save_model` does not
    return buffer.getvalue()

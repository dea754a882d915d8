"""Figures written to disk (matplotlib, no display needed): the learning curve
of a run and a grid of attention heads."""

import numpy as np

from keras_transformer.utils.files import atomic_path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


def plot_learning_curve(epochs, path, by_step=False):
    """Loss and token accuracy per epoch (train and validation), and the
    validation BLEU when the run measured it (`train --val-bleu N`), as a PNG.

    Args:
        epochs: the `metrics.json` entries, dicts with `epoch`, `loss`,
            `token_accuracy` and optionally `val_loss`, `val_token_accuracy`,
            `val_bleu`, `optimizer_steps`.
        path: where the PNG goes.
        by_step: the x axis is the optimizer's updates (`optimizer_steps`), as
            for a run validated every N updates (`train --val-every-steps N`).
    """
    pyplot = _pyplot()
    x_key, x_label = ("optimizer_steps", "update") if by_step else ("epoch", "epoch")
    bleu = [(entry[x_key], entry["val_bleu"]) for entry in epochs if entry.get("val_bleu") is not None]
    figure, axes = pyplot.subplots(1, 3 if bleu else 2, figsize=(15 if bleu else 10, 4))
    if bleu:
        axes[2].plot(*zip(*bleu), "--s", color="tab:orange", label="val (greedy)")
        axes[2].set_xlabel(x_label)
        axes[2].set_title("BLEU")
        axes[2].grid(alpha=0.3)
        axes[2].legend()
    numbers = [entry[x_key] for entry in epochs]
    for key, axis in (("loss", axes[0]), ("token_accuracy", axes[1])):
        for prefix, style in (("", "-o"), ("val_", "--s")):
            values = [entry.get(prefix + key) for entry in epochs]
            if all(value is not None for value in values):
                axis.plot(numbers, values, style, label=(prefix or "train_").rstrip("_"))
        axis.set_xlabel(x_label)
        axis.set_title(key.replace("_", " "))
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    _save(figure, path)
    pyplot.close(figure)


def plot_validation_curves(runs, path):
    """Validation loss and greedy validation BLEU against wall-clock minutes, one line per run.

    Args:
        runs: `(label, epochs)` pairs, `epochs` being a run's `metrics.json`
            entries; the x axis is the cumulative `seconds` of the epochs.
        path: where the PNG goes.
    """
    pyplot = _pyplot()
    figure, (loss_axis, bleu_axis) = pyplot.subplots(1, 2, figsize=(12, 4.5))
    for label, epochs in runs:
        minutes = np.cumsum([entry["seconds"] for entry in epochs]) / 60
        loss_axis.plot(minutes, [entry.get("val_loss") for entry in epochs], "-o", markersize=3, label=label)
        bleu = [(m, e["val_bleu"]) for m, e in zip(minutes, epochs) if e.get("val_bleu") is not None]
        if bleu:
            bleu_axis.plot(*zip(*bleu), "-s", markersize=3, label=label)
    for axis, title in ((loss_axis, "validation loss"), (bleu_axis, "validation BLEU (greedy)")):
        axis.set_xlabel("wall-clock minutes (training + validation)")
        axis.set_title(title)
        axis.grid(alpha=0.3)
        if axis.lines:
            axis.legend()
    figure.tight_layout()
    _save(figure, path)
    pyplot.close(figure)


def plot_attention(weights, source_tokens, target_tokens, path):
    """Every head of every attention layer of one sentence, as a PNG grid.

    Args:
        weights: `Transformer.attention_weights(...)` for a batch of one: a dict
            of lists of `(1, num_heads, len_q, len_k)` arrays.
        source_tokens, target_tokens: the pieces labelling the axes (target
            tokens are the decoder inputs, BOS first).
        path: where the PNG goes.
    """
    pyplot = _pyplot()
    labels = {
        "encoder_self": (source_tokens, source_tokens),
        "decoder_self": (target_tokens, target_tokens),
        "decoder_cross": (target_tokens, source_tokens),
    }
    rows = [
        (kind, index, np.asarray(layer)[0])
        for kind in ("encoder_self", "decoder_self", "decoder_cross")
        for index, layer in enumerate(weights[kind])
    ]
    heads = rows[0][2].shape[0]
    cell = max(2.0, 0.25 * max(len(source_tokens), len(target_tokens)))
    figure, axes = pyplot.subplots(len(rows), heads, figsize=(cell * heads, cell * len(rows)), squeeze=False)
    for row, (kind, index, layer) in enumerate(rows):
        queries, keys = labels[kind]
        for head in range(heads):
            axis = axes[row][head]
            axis.imshow(layer[head][: len(queries), : len(keys)], cmap="viridis", vmin=0.0)
            axis.set_xticks(range(len(keys)), keys, rotation=90, fontsize=6)
            axis.set_yticks(range(len(queries)), queries, fontsize=6)
            axis.set_title(f"{kind} layer {index + 1} head {head + 1}", fontsize=7)
    figure.tight_layout()
    _save(figure, path)
    pyplot.close(figure)


def _save(figure, path):
    with atomic_path(path, suffix=".png") as temporary:
        figure.savefig(temporary, dpi=100, format="png")

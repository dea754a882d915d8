"""A side-by-side sweep of the Multi30k recipe's training settings, trained on the JAX backend.

The recipe (`scripts/reproduce_multi30k.sh`) takes two hours of this project's 2-core machine per
85-epoch run, so its rows are measured one per session. This script trains several variants of it
side by side, each in its own process, on any machine where Keras runs on JAX (an accelerator
machine without TensorFlow included), on exactly the recipe's batches:

    prepare   (here, with TensorFlow): the recipe's tokenizer, its training pairs as token ids and
              the batch plan of every epoch for each seed, as `TokenizedPairs` makes them (the
              order fixed by `(seed, epoch)`), into one folder;
    train     (KERAS_BACKEND=jax, no TensorFlow): one process per variant trains the library's
              `Transformer` with `compile_transformer` (the recipe's loss, Adam and schedule) on
              those batches, averages the last checkpoints like the recipe and writes each
              variant's averaged weights (float16, by variable path) and its per-epoch losses;
    evaluate  (here): loads each variant's weights into the recipe's model and scores val with the
              recipe's evaluation (`keras-transformer evaluate`, beam and alpha given), into a
              results file.

A variant changes the recipe's model settings (`set`), its learning rate, warmup, clip-norm or
label smoothing, or its seed. Matrix products run in full float32 (`highest` precision), so an
accelerator trains the same function as the CPU; the rows compare with each other, trained side by
side here, and not with the CPU recipe's figures (the JAX backend draws other initial weights and
dropout masks than TensorFlow for the same seed: after 2 epochs its losses were 5.50 / val 5.13
against the TensorFlow run's 5.42 / 5.01, and seed 1 gave 5.53 / 5.14).

What has been run (2026-11-28): `prepare`, `train --epochs 2` and `evaluate` end to end on the
2-core CPU (JAX backend); on an H200, 8 variants stalled for 9 minutes in XLA's compilation of a
Triton GEMM fusion ("Very slow compile") until `train` set `XLA_FLAGS` to cuBLAS GEMMs without
autotuning; with them, 2 variants trained epoch 1 in 97 s each (all compiles included), their
losses equal to the CPU's to 5 digits (7.23104 against 7.23103). Then 6 variants at once for 510 s
(`results/multi30k_sweep_h200_36epochs.json`, docs/results.md): epoch 1 ~150 s, then ~8 s per
epoch each (~1.4 s of the GPU per variant-epoch), stopped at the deadline after 36-40 epochs. So
three variants fit 85 epochs in one 600-second call; six do not. A second call (2 seeds, a 240 s
deadline) stopped both after epoch 1 (144 s of compiles), because the deadline then took the
mean epoch, compiles included, for the next one's time; it now takes the last epoch's.

A variant that reaches `--deadline-seconds` stops and still writes its weights, averaged over its
last `average_last` epochs, and its epoch count; the first to stop records its epoch in a file
that makes the others stop there too (those already past it stop at once).

    python scripts/sweep_multi30k.py prepare --run runs/multi30k --data-dir ../shared/data/multi30k \
        --out sweep --seeds 0,1 --epochs 85
    KERAS_BACKEND=jax python scripts/sweep_multi30k.py train --prepared sweep --variants VARIANTS.json \
        --out OUT --deadline-seconds 480
    python scripts/sweep_multi30k.py evaluate --prepared sweep --weights OUT --data-dir ... \
        --json results/multi30k_sweep.json
"""

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np


def _store(data, split):
    """The `TokenStore` of `split` ("train" or "val") from the prepared arrays (no TensorFlow)."""
    from keras_transformer.data.token_store import TokenStore

    return TokenStore(
        *(data[f"{split}_{side}_{kind}"] for side in ("source", "target") for kind in ("ids", "offsets"))
    )


def prepare(args):
    from keras_transformer.data.batching import TokenizedPairs
    from keras_transformer.data.corpora import ParallelText, load_corpus
    from keras_transformer.data.token_store import TokenStore
    from keras_transformer.training.setup import load_tokenizer

    run = pathlib.Path(args.run)
    settings = json.loads((run / "run.json").read_text())
    options = settings["options"]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(run / "tokenizer.model")
    corpus = load_corpus(
        "multi30k", args.data_dir, settings["source_lang"], settings["target_lang"], stream=True
    )
    train_pairs, val_pairs = corpus.train_and_validation(print)
    cache = tempfile.mkdtemp()  # the token cache, removed once the arrays are written
    if isinstance(train_pairs, ParallelText):
        store = TokenStore.cached(train_pairs, tokenizer, cache, print)
    else:
        store = TokenStore.from_texts(*train_pairs, tokenizer)
    max_length = settings["model"]["max_length"]
    batches = TokenizedPairs(store, batch_tokens=options["batch_tokens"], max_length=max_length)
    validation = TokenizedPairs.from_texts(
        *val_pairs, tokenizer, batch_tokens=options["batch_tokens"], max_length=max_length
    )
    arrays = {}
    for name, pairs in (("train", batches), ("val", validation)):
        for side in ("source", "target"):
            arrays[f"{name}_{side}_ids"] = np.asarray(pairs.store.ids[side])
            arrays[f"{name}_{side}_offsets"] = np.asarray(pairs.store.offsets[side], np.int64)
    val_plan = list(validation.plan(None, None))
    arrays["val_indices"] = np.concatenate([indices for indices, _ in val_plan]).astype(np.int32)
    arrays["val_sizes"] = np.array([len(indices) for indices, _ in val_plan], np.int32)
    arrays["val_lengths"] = np.array([length for _, length in val_plan], np.int32)
    for seed in args.seeds:
        indices, sizes, lengths = [], [], []
        for epoch in range(args.epochs):
            plan = list(batches.plan(epoch, seed))
            assert len(plan) == batches.info.batches
            indices += [np.asarray(i, np.int32) for i, _ in plan]
            sizes += [len(i) for i, _ in plan]
            lengths += [length for _, length in plan]
        arrays[f"plan{seed}_indices"] = np.concatenate(indices)
        arrays[f"plan{seed}_sizes"] = np.array(sizes, np.int32)
        arrays[f"plan{seed}_lengths"] = np.array(lengths, np.int32)
    np.savez_compressed(out / "corpus.npz", **arrays)
    shutil.rmtree(cache)
    meta = {
        "model": settings["model"],
        "options": {
            key: options[key] for key in ("learning_rate", "warmup_steps", "label_smoothing", "clip_norm")
        },
        "average_last": options["average_last"],
        "batches_per_epoch": batches.info.batches,
        "epochs": args.epochs,
        "seeds": args.seeds,
        "run": str(run),
    }
    (out / "prepared.json").write_text(json.dumps(meta, indent=1))
    print(f"prepared {args.epochs} epochs x {batches.info.batches} batches for seeds {args.seeds} in {out}")


def _variant_settings(meta, variant):
    """`(training settings, model settings)`: the prepared run's, with the variant's changes."""
    settings = {"seed": 0, **meta["options"]}
    settings.update({key: value for key, value in variant.items() if key not in ("name", "set")})
    model = dict(meta["model"])
    model.update(variant.get("set", {}))
    return settings, model


def _should_stop(args, epoch, elapsed, last_epoch_seconds):
    """Whether a variant stops after `epoch`: at the first variant's deadline epoch (the stop file), or
    when its own next epoch, taken as 1.5 times its last one, would end past the deadline (the mean
    would count epoch 1's compiles: 144 s on an H200 against ~4 s for the next ones), which it then
    records for the others, so that variants sharing a machine stop after the same epoch where
    they can."""
    stop_file = pathlib.Path(args.stop_file) if args.stop_file else None
    if stop_file and stop_file.exists() and epoch >= int(stop_file.read_text()):
        return True
    if args.deadline_seconds and elapsed + 1.5 * last_epoch_seconds > args.deadline_seconds:
        if stop_file and not stop_file.exists():
            written = stop_file.with_suffix(f".{os.getpid()}")
            written.write_text(str(epoch))
            os.replace(written, stop_file)  # whole or absent, never read half-written
        return True
    return False


def train_one(args):
    """One variant, in this process (KERAS_BACKEND=jax)."""
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    import keras

    from keras_transformer.data.special_ids import PAD_ID
    from keras_transformer.model.config import TransformerConfig
    from keras_transformer.model.transformer import Transformer
    from keras_transformer.training.checkpoints import atomic_save_weights, average_checkpoints
    from keras_transformer.training.optimizer import compile_transformer

    started = time.monotonic()
    prepared = pathlib.Path(args.prepared)
    meta = json.loads((prepared / "prepared.json").read_text())
    variant = json.loads(args.variant)
    settings, model_settings = _variant_settings(meta, variant)
    seed = settings["seed"]
    data = np.load(prepared / "corpus.npz")
    store, val_store = _store(data, "train"), _store(data, "val")
    # A seed without a plan of its own trains on the first seed's batches (other weights and dropout only).
    plan_seed = seed if f"plan{seed}_indices" in data else meta["seeds"][0]
    plan_indices, sizes, lengths = (data[f"plan{plan_seed}_{key}"] for key in ("indices", "sizes", "lengths"))
    starts = np.concatenate([[0], np.cumsum(sizes)])
    per_epoch, epochs, average_last = meta["batches_per_epoch"], meta["epochs"], meta["average_last"]
    epochs = min(epochs, args.epochs or epochs)

    keras.utils.set_random_seed(seed)
    model = Transformer(TransformerConfig.from_dict(model_settings))
    model.build()
    compile_transformer(
        model,
        settings["label_smoothing"],
        settings["warmup_steps"],
        peak_learning_rate=settings["learning_rate"],
        clip_norm=settings["clip_norm"],
        fused_step=False,
        jit_compile=True,
    )

    def batch(i):
        indices = plan_indices[starts[i] : starts[i + 1]]
        source, target_in, labels = store.batch(indices, int(lengths[i]), len(indices))
        return {"source_ids": source, "target_ids": target_in}, labels

    val_sizes, val_lengths = data["val_sizes"], data["val_lengths"]
    val_starts = np.concatenate([[0], np.cumsum(val_sizes)])
    val_batches = []
    for i in range(len(val_sizes)):
        indices = data["val_indices"][val_starts[i] : val_starts[i + 1]]
        source, target_in, labels = val_store.batch(indices, int(val_lengths[i]), len(indices))
        val_batches.append(({"source_ids": source, "target_ids": target_in}, labels))

    checkpoints = pathlib.Path(tempfile.mkdtemp())  # the last epochs' weights, averaged as the recipe does
    history, averaged, stopped = [], [], None
    for epoch in range(epochs):
        epoch_started, losses = time.monotonic(), []
        for i in range(epoch * per_epoch, (epoch + 1) * per_epoch):
            x, y = batch(i)
            losses.append(model.train_on_batch(x, y, return_dict=False))
        train_loss = float(np.mean([np.asarray(loss).reshape(-1)[0] for loss in losses]))
        row = {"epoch": epoch + 1, "loss": train_loss, "seconds": round(time.monotonic() - epoch_started, 2)}
        if (epoch + 1) % 5 == 0 or epoch + 1 == epochs:
            val = [model.test_on_batch(x, y, return_dict=True) for x, y in val_batches]
            weights = [float((y != PAD_ID).sum()) for _, y in val_batches]  # label tokens
            row["val_loss"] = float(np.average([v["loss"] for v in val], weights=weights))
        history.append(row)
        print(json.dumps({"variant": variant["name"], **row}), flush=True)
        # The last `average_last` epochs' weights, kept as a rolling window: the schedule does not
        # depend on the number of epochs, so a variant stopped at the deadline after epoch E holds
        # what the full run held at epoch E, averaged over the same window.
        averaged.append(str(checkpoints / f"epoch-{epoch + 1:04d}.weights.h5"))
        atomic_save_weights(model, averaged[-1])
        if len(averaged) > average_last:
            os.remove(averaged.pop(0))
        elapsed = time.monotonic() - started
        if epoch + 1 < epochs and _should_stop(args, epoch + 1, elapsed, row["seconds"]):
            stopped = epoch + 1
            break
    result = {
        "name": variant["name"],
        "averaged_epochs": [len(history) - len(averaged) + 1, len(history)] if averaged else None,
        "variant": variant,
        "settings": settings,
        "model": model_settings,
        "epochs_trained": len(history),
        "stopped_at_deadline": stopped,
        "averaged_checkpoints": len(averaged),
        "plan_seed": plan_seed,
        "history": history,
        "seconds": round(time.monotonic() - started, 1),
        "device": str(jax.devices()[0]),
    }
    weights = {}
    if averaged:
        average_checkpoints(model, averaged)
        weights = {v.path: np.asarray(v.value).astype(np.float16) for v in model.weights}
    shutil.rmtree(checkpoints)
    np.savez(pathlib.Path(args.out) / f"{variant['name']}.npz", result=json.dumps(result), **weights)
    print(json.dumps({"variant": variant["name"], "done": True, "seconds": result["seconds"]}), flush=True)


def train(args):
    """Every variant of `--variants`, each in its own process, all at once."""
    variants = json.loads(pathlib.Path(args.variants).read_text())
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    environment = dict(os.environ, KERAS_BACKEND="jax", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    # On an H200 the train step's first compile stalled for over 9 minutes in every process
    # ("Very slow compile" of a Triton GEMM fusion, 2026-11-28): cuBLAS GEMMs, no autotuning.
    environment.setdefault("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=false --xla_gpu_autotune_level=0")
    logs = pathlib.Path(args.logs or out)
    logs.mkdir(parents=True, exist_ok=True)
    (logs / "stop-epoch").unlink(missing_ok=True)
    processes = []
    for variant in variants:
        command = [
            sys.executable,
            __file__,
            "train-one",
            "--prepared",
            args.prepared,
            "--out",
            args.out,
            "--variant",
            json.dumps(variant),
            "--deadline-seconds",
            str(args.deadline_seconds),
            "--epochs",
            str(args.epochs),
            "--stop-file",
            str(logs / "stop-epoch"),
        ]
        log = open(logs / f"{variant['name']}.log", "w")
        processes.append(
            (
                variant["name"],
                subprocess.Popen(command, env=environment, stdout=log, stderr=subprocess.STDOUT),
            )
        )
    for name, process in processes:
        code = process.wait()
        print(f"{name}: exit {code}", flush=True)
        lines = (logs / f"{name}.log").read_text().splitlines()
        print("\n".join(lines[-3:]), flush=True)


def evaluate(args):
    """Each variant's averaged weights, scored on val with the recipe's evaluation."""
    import keras

    from keras_transformer.model.config import TransformerConfig
    from keras_transformer.model.transformer import Transformer

    prepared = pathlib.Path(args.prepared)
    meta = json.loads((prepared / "prepared.json").read_text())
    run = pathlib.Path(meta["run"])
    rows = []
    for path in sorted(pathlib.Path(args.weights).glob("*.npz")):
        data = np.load(path)
        result = json.loads(str(data["result"]))
        if not result["averaged_checkpoints"]:
            rows.append({**result, "val_bleu": None})
            continue
        model = Transformer(TransformerConfig.from_dict(result["model"]))
        model.build()
        for variable in model.weights:
            variable.assign(data[variable.path].astype(np.float32))
        folder = pathlib.Path(args.scratch) / result["name"]
        folder.mkdir(parents=True, exist_ok=True)
        model.save(folder / "averaged.keras")
        (folder / "tokenizer.model").write_bytes((run / "tokenizer.model").read_bytes())
        settings = json.loads((run / "run.json").read_text())
        settings["model"] = result["model"]
        (folder / "run.json").write_text(json.dumps(settings, indent=1))
        command = [
            os.path.join(os.path.dirname(sys.executable), "keras-transformer"),
            "evaluate",
            "--model",
            str(folder / "averaged.keras"),
            "--data",
            "multi30k",
            "--split",
            "val",
            "--beam-size",
            str(args.beam_size),
            "--length-penalty",
            str(args.length_penalty),
            "--output",
            str(folder / "translations-val.txt"),
        ]
        if args.data_dir:
            command += ["--data-dir", args.data_dir]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        scores = json.loads((folder / "eval-multi30k-val.json").read_text())
        rows.append({**result, "val_bleu": scores["bleu"], "val_chrf": scores.get("chrf")})
        keras.backend.clear_session()
    rows.sort(key=lambda row: -(row["val_bleu"] or -1))
    print(f"{'variant':<28} {'epochs':>6} {'val loss':>9} {'val BLEU':>9} {'val chrF':>9}")
    for row in rows:
        last_val = [h["val_loss"] for h in row["history"] if "val_loss" in h]
        bleu = "-" if row["val_bleu"] is None else f"{row['val_bleu']:.2f}"
        chrf = "-" if row.get("val_chrf") is None else f"{row['val_chrf']:.2f}"
        val_loss = f"{last_val[-1]:.4f}" if last_val else "-"
        print(f"{row['name']:<28} {row['epochs_trained']:>6} {val_loss:>9} {bleu:>9} {chrf:>9}")
    if args.json:
        summary = {
            "what": "the recipe's variants trained side by side (scripts/sweep_multi30k.py), scored on val",
            "decoding": {"beam_size": args.beam_size, "length_penalty": args.length_penalty},
            "prepared": meta,
            "rows": [{key: value for key, value in row.items()} for row in rows],
        }
        pathlib.Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("prepare")
    p.add_argument("--run", required=True, help="a recipe run (its run.json and tokenizer.model)")
    p.add_argument("--data-dir")
    p.add_argument("--out", required=True)
    p.add_argument("--seeds", type=lambda text: [int(s) for s in text.split(",")], default=[0])
    p.add_argument("--epochs", type=int, default=85)
    p = commands.add_parser("train")
    p.add_argument("--prepared", required=True)
    p.add_argument("--variants", required=True, help="a JSON list of {name, set?, learning_rate?, ...}")
    p.add_argument("--out", required=True)
    p.add_argument("--deadline-seconds", type=float, default=0)
    p.add_argument("--epochs", type=int, default=0, help="fewer epochs than prepared (a trial)")
    p.add_argument("--logs", help="where each variant's log goes (default: --out)")
    p = commands.add_parser("train-one")
    p.add_argument("--prepared", required=True)
    p.add_argument("--variant", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--deadline-seconds", type=float, default=0)
    p.add_argument("--epochs", type=int, default=0, help="fewer epochs than prepared (a trial)")
    p.add_argument("--stop-file", help="where the first variant to reach the deadline writes its epoch")
    p = commands.add_parser("evaluate")
    p.add_argument("--prepared", required=True)
    p.add_argument("--weights", required=True, help="the folder `train` wrote")
    p.add_argument("--data-dir")
    p.add_argument("--scratch", default="/tmp/sweep-evaluate")
    p.add_argument("--beam-size", type=int, default=8)
    p.add_argument("--length-penalty", type=float, default=1.0)
    p.add_argument("--json")
    args = parser.parse_args()
    {"prepare": prepare, "train": train, "train-one": train_one, "evaluate": evaluate}[args.command](args)


if __name__ == "__main__":
    main()

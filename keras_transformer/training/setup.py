"""A training run's preparation, everything before `model.fit`: the options checked
against a resumed run's, the corpus, the shared vocabulary, the model config, the
batches, the run directory's settings, and the compiled model under its
distribution strategy, restored from the newest snapshot when resuming.

Every input is checked (corpus, vocabulary, model config) before the run
directory is created, so bad input leaves nothing behind.
"""

import dataclasses

import keras
import tensorflow as tf

from keras_transformer.data.batching import TokenizedPairs
from keras_transformer.data.corpora import MixedText, ParallelText, cache_dir, load_corpus
from keras_transformer.data.token_store import StoreSequence, TokenStore
from keras_transformer.data.tokenizer import Tokenizer
from keras_transformer.model.config import TransformerConfig
from keras_transformer.model.transformer import Transformer
from keras_transformer.training.checkpoints import restore_latest
from keras_transformer.training.distribution import select_strategy, worker_index
from keras_transformer.training.optimizer import build_for_fit, compile_transformer
from keras_transformer.training.options import RUN_DEFINING
from keras_transformer.utils.checks import UserError


@dataclasses.dataclass
class PreparedRun:
    """What `model.fit` needs, made by `prepare_run`.

    `epoch` and `step` are where training resumes (`(0, 0)` for a new run);
    `workers` is the number of workers in the strategy (multi-worker splits each
    batch by rows); `val_pairs` are the validation (sources, targets).
    """

    strategy: object
    workers: int
    model: Transformer
    tokenizer: Tokenizer
    batches: TokenizedPairs
    validation: TokenizedPairs
    val_pairs: tuple
    epoch: int
    step: int


def prepare_run(run, options, log):
    """A `PreparedRun` for `options` in `run` (locked by the caller); `UserError` for bad input."""
    run.check_can_start(options.resume, options.overwrite)  # again, now under the lock
    strategy = select_strategy(options.strategy)  # before any TF op (multi-worker needs that)
    _, workers = worker_index(strategy)
    stored = run.settings() if options.resume and run.settings_path.exists() else None
    if stored is not None:
        _check_same_run(stored["options"], options)
    _model_config(options, options.vocab_size or DEFAULT_VOCAB_SIZE)  # the settings, before any corpus
    initial = given_tokenizer = None
    if options.tokenizer:
        given_tokenizer = load_tokenizer(options.tokenizer, options.vocab_size)
    if options.init_from and stored is None:
        initial = InitialModel(options, given_tokenizer)
    keras.utils.set_random_seed(options.seed)
    corpus = load_corpus(
        options.data, options.data_dir, options.source_lang, options.target_lang, stream=True
    )
    train_pairs, val_pairs = corpus.train_and_validation(log)
    if stored is not None:
        tokenizer = run.tokenizer()
    elif initial is not None:
        tokenizer = initial.tokenizer
    elif given_tokenizer is not None:
        tokenizer = given_tokenizer
    else:
        tokenizer = _train_tokenizer(train_pairs, options.vocab_size, options.seed, log)
    if initial is not None:
        config = initial.config
    elif stored is not None and stored["options"].get("init_from"):
        config = TransformerConfig.from_dict(stored["model"])
    else:
        config = _model_config(options, tokenizer.vocab_size)
    max_length = min(options.max_length or config.max_length, config.max_length)
    cache, weights = options.token_cache or token_cache_dir(), None
    if isinstance(train_pairs, MixedText):
        _check_tags(train_pairs.tags, tokenizer, log)
        store = StoreSequence(TokenStore.cached(part, tokenizer, cache, log) for part in train_pairs.parts)
        weights = train_pairs.weights
        log(_describe_mix(train_pairs, store))
    elif isinstance(train_pairs, ParallelText):
        store = TokenStore.cached(train_pairs, tokenizer, cache, log)
    else:
        store = TokenStore.from_texts(*train_pairs, tokenizer)
    try:
        batches = TokenizedPairs(
            store,
            batch_tokens=options.batch_tokens,
            max_length=max_length,
            row_multiple=workers,
            weights=weights,
        )
    except ValueError as error:  # a corpus of the mix without a pair that fits
        raise UserError(f"{error}.") from None
    if batches.info.examples == 0:
        raise UserError(f"No training pair fits in {max_length} tokens; raise --max-length.")
    validation = TokenizedPairs.from_texts(
        *val_pairs,
        tokenizer,
        batch_tokens=options.batch_tokens,
        max_length=config.max_length,
        row_multiple=workers,
    )

    run.create(resume=options.resume, overwrite=options.overwrite)
    if stored is None and run.settings_path.exists() and not options.overwrite:
        raise UserError(
            f"Another process started a run in {run.path} meanwhile; run the command again to resume it."
        )
    if stored is None:
        tokenizer.save(run.tokenizer_path)
        run.write_json(
            run.settings_path,
            {
                "options": _jsonable(options),
                "model": config.to_dict(),
                "source_lang": corpus.source_lang,
                "target_lang": corpus.target_lang,
            },
        )
    log(
        f"Training pairs: {batches.info.examples:,} kept, {batches.info.dropped:,} longer than "
        f"{max_length} tokens dropped; {batches.info.batches} batches per epoch; "
        f"{len(val_pairs[0]):,} validation pairs."
    )
    _warn_if_warmup_outlasts_the_run(options, batches.info.batches, log)
    total_steps, cooldown_steps = cooldown_updates(options, batches.info.batches)
    if cooldown_steps:
        log(
            f"Learning rate: falls linearly to zero over the last {cooldown_steps:,} of "
            f"{total_steps:,} updates (--cooldown {options.cooldown})."
        )
    # The model's layers take the mixed policy when they are made; the caller's global policy is
    # restored afterwards (a Python caller's next model is not silently mixed).
    previous_policy = keras.config.dtype_policy()
    if options.mixed_precision:
        keras.config.set_dtype_policy(mixed_precision_policy())
    try:
        with strategy.scope():
            model = Transformer(config)
            model.build()
            if initial is not None:
                initial.load_into(model, log)
            freeze(model, options.freeze)
            compile_transformer(
                model,
                options.label_smoothing,
                options.warmup_steps,
                options.learning_rate_scale,
                grad_accum=options.grad_accum,
                peak_learning_rate=options.learning_rate,
                clip_norm=options.clip_norm,
                jit_compile=options.xla,
                total_steps=total_steps,
                cooldown_steps=cooldown_steps,
            )
            build_for_fit(model)
    finally:
        keras.config.set_dtype_policy(previous_policy)
    log(
        f"Model: preset {options.preset}, {model.count_params():,} parameters, "
        f"{strategy.num_replicas_in_sync} replica(s), --strategy {options.strategy}."
    )
    epoch, step = (
        restore_latest(model, run.state_dir, run.checkpoints_dir, log) if stored is not None else (0, 0)
    )
    return PreparedRun(strategy, workers, model, tokenizer, batches, validation, val_pairs, epoch, step)


class InitialModel:
    """`--init-from RUN_OR_KERAS`: the trained model a new run starts from (fine-tuning), with its
    tokenizer and architecture (`--set` may change what does not change a weight's shape, such as
    dropout_rate); checked before the corpus is read."""

    def __init__(self, options, given_tokenizer=None):
        from keras_transformer.training.run_directory import resolve_model

        self.run, self.path = resolve_model(options.init_from)
        self.tokenizer = self.run.tokenizer()
        if given_tokenizer is not None and given_tokenizer.model_proto != self.tokenizer.model_proto:
            raise UserError(
                f"--tokenizer {options.tokenizer} is not the vocabulary of --init-from {options.init_from} "
                f"({given_tokenizer.vocab_size} vs {self.tokenizer.vocab_size} pieces, or other pieces); a "
                f"fine-tuned model keeps its own vocabulary: leave --tokenizer out."
            )
        if options.vocab_size and options.vocab_size != self.tokenizer.vocab_size:
            raise UserError(
                f"--vocab-size {options.vocab_size}, but --init-from {options.init_from} has a vocabulary of "
                f"{self.tokenizer.vocab_size} pieces; leave --vocab-size out."
            )
        try:
            self.config = TransformerConfig.from_dict(self.run.settings()["model"]).replace(
                **options.overrides
            )
        except (TypeError, ValueError) as error:
            raise UserError(f"Invalid --set for --init-from {options.init_from}: {error}") from None

    def load_into(self, model, log):
        from keras_transformer.training.run_directory import load_model

        source = load_model(self.path)
        try:
            model.set_weights(source.get_weights())
        except ValueError as error:
            raise UserError(
                f"--init-from {self.path}: its weights do not fit the model --set makes ({error}); "
                f"change only settings that keep the shapes (e.g. dropout_rate)."
            ) from None
        log(
            f"Initialized from {self.path} ({source.count_params():,} parameters); a fresh optimizer "
            f"and schedule."
        )


FREEZABLE = ("embeddings", "encoder")


def freeze(model, parts):
    """Makes `parts` (`--freeze`: embeddings, encoder) of `model` untrainable, before it is compiled.
    With tied embeddings, freezing them freezes the output projection too."""
    for part in parts or ():
        layers = [model.source_embedding, model.target_embedding] if part == "embeddings" else [model.encoder]
        for layer in layers:
            layer.trainable = False


def load_tokenizer(path, vocab_size=None):
    """`--tokenizer FILE.model`: one's own SentencePiece model, its special ids checked (<pad> 0,
    <unk> 1, <s> 2, </s> 3, as `Tokenizer.train` makes them)."""
    from keras_transformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID

    try:
        tokenizer = Tokenizer.load(path)
    except (OSError, RuntimeError) as error:
        raise UserError(f"--tokenizer {path}: not a SentencePiece model that loads ({error}).") from None
    processor = tokenizer.processor
    found = (processor.pad_id(), processor.unk_id(), processor.bos_id(), processor.eos_id())
    if found != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
        raise UserError(
            f"--tokenizer {path}: its special ids are <pad> {found[0]}, <unk> {found[1]}, <s> {found[2]}, "
            f"</s> {found[3]}; keras-transformer needs 0, 1, 2, 3: train it with --pad_id=0 --unk_id=1 "
            f"--bos_id=2 --eos_id=3."
        )
    if vocab_size and vocab_size != tokenizer.vocab_size:
        raise UserError(
            f"--vocab-size {vocab_size}, but --tokenizer {path} has {tokenizer.vocab_size} pieces; "
            f"leave --vocab-size out."
        )
    return tokenizer


DEFAULT_VOCAB_SIZE = 8000
VOCABULARY_SAMPLE_PAIRS = 300_000  # a corpus read from files trains its vocabulary on at most these


def token_cache_dir():
    """Where tokenized training corpora are kept by default: `token_cache` in the download cache."""
    return cache_dir() / "token_cache"


def _check_tags(tags, tokenizer, log):
    """A tag of a weighted mix should be one piece of the vocabulary (a vocabulary trained here
    makes it one; one brought with --tokenizer or --init-from may not)."""
    for tag in tags:
        if len(tokenizer.ids_in_python([tag])[0]) != 1:
            log(f"Warning: the tag {tag} is not one piece of this vocabulary; it is split into several.")


def _describe_mix(mix, store):
    shares = [weight / sum(mix.weights) for weight in mix.weights]
    parts = ", ".join(
        f"{files.source} ({part.pairs:,} pairs, {share:.0%} of each epoch"
        f"{f', tag {files.tag}' if files.tag else ''})"
        for files, part, share in zip(mix.files, store.parts, shares)
    )
    return f"Training corpora mixed by weight: {parts}."


def _train_tokenizer(train_pairs, vocab_size, seed, log):
    """The shared vocabulary; an explicit size the corpus cannot support is an error, the default is
    capped. A corpus read from files is sampled: at most `VOCABULARY_SAMPLE_PAIRS` pairs; the
    tags of a weighted mix are pieces of their own."""
    tags = train_pairs.tags if isinstance(train_pairs, MixedText) else ()
    if isinstance(train_pairs, (ParallelText, MixedText)):
        if train_pairs.count > VOCABULARY_SAMPLE_PAIRS:
            log(f"Vocabulary: trained on {VOCABULARY_SAMPLE_PAIRS:,} pairs drawn from {train_pairs.count:,}.")
        train_pairs = train_pairs.sample(VOCABULARY_SAMPLE_PAIRS, seed)
    texts = train_pairs[0] + train_pairs[1]
    if vocab_size is not None:
        return Tokenizer.train(texts, vocab_size, user_defined_symbols=tags)
    tokenizer = Tokenizer.train(texts, DEFAULT_VOCAB_SIZE, cap_to_corpus=True, user_defined_symbols=tags)
    if tokenizer.vocab_size < DEFAULT_VOCAB_SIZE:
        log(
            f"Vocabulary: {tokenizer.vocab_size} pieces, the most this corpus supports (the default "
            f"is {DEFAULT_VOCAB_SIZE}; --vocab-size sets it)."
        )
    return tokenizer


def run_updates(options, batches_per_epoch):
    """`(updates, how)`: the weight updates the whole run makes (`--steps`, or `--epochs` of
    `batches_per_epoch` batches / `--grad-accum`), and the options that say so, for messages.
    Keras' gradient accumulation counts batches across epochs, so an update may take batches of
    two epochs: the run's batches are divided, not each epoch's."""
    if options.steps:
        return options.steps, f"--steps {options.steps}"
    updates = max(1, options.epochs * batches_per_epoch // options.grad_accum)
    how = (
        f"{options.epochs} epoch(s) of {batches_per_epoch} batches"
        f"{f' / --grad-accum {options.grad_accum}' if options.grad_accum > 1 else ''}"
    )
    return updates, how


def cooldown_updates(options, batches_per_epoch):
    """`(total_steps, cooldown_steps)` of the learning-rate schedule for `--cooldown FRACTION`
    (`(None, 0)` without it): the run's last `FRACTION` of its updates, at least one."""
    if options.cooldown is None:
        return None, 0
    updates, _ = run_updates(options, batches_per_epoch)
    return updates, max(1, round(options.cooldown * updates))


def _warn_if_warmup_outlasts_the_run(options, batches_per_epoch, log):
    """A warning when the learning rate would still be warming up at the run's last update: it
    then never leaves its first small values, and a short run learns next to nothing."""
    updates, length = run_updates(options, batches_per_epoch)
    if options.warmup_steps >= updates:
        log(
            f"Warning: --warmup-steps {options.warmup_steps} is longer than the whole run ({updates:,} "
            f"updates: {length}); the learning rate never reaches its peak and the model may "
            f"translate nothing. Give a --warmup-steps well under {updates:,} (the demo: 400 of "
            f"1,130) or a longer run (--epochs, --steps)."
        )


def _model_config(options, vocab_size):
    try:
        return TransformerConfig.from_preset(options.preset, vocab_size=vocab_size, **options.overrides)
    except (TypeError, ValueError) as error:
        raise UserError(f"Invalid model settings (--preset {options.preset}, --set): {error}") from None


def mixed_precision_policy():
    """`"mixed_float16"` where TensorFlow sees a GPU, else `"mixed_bfloat16"` (CPU)."""
    return "mixed_float16" if tf.config.list_logical_devices("GPU") else "mixed_bfloat16"


def _jsonable(options):
    return {
        key: value
        for key, value in dataclasses.asdict(options).items()
        if key not in ("resume", "overwrite", "verbose")
    }


def _check_same_run(stored, options):
    current = _jsonable(options)
    # No --vocab-size: the stored vocabulary is reused whatever its size (runs made
    # before the default became "8000, capped to the corpus" stored 8000).
    changed = [
        key
        for key in RUN_DEFINING
        if stored.get(key) != current.get(key) and not (key == "vocab_size" and current.get(key) is None)
    ]
    if changed:
        details = ", ".join(f"{key}: {stored.get(key)!r} -> {current.get(key)!r}" for key in changed)
        raise UserError(
            f"--resume with different settings than the stored run ({details}); "
            f"use the original settings or --overwrite."
        )

"""Scoring a trained run on a corpus split: what `keras-transformer evaluate` does,
as a function that returns its results (the CLI only prints them).

Translates the split with beam search (§6.1), scores sacreBLEU, chrF and the
paper's tokenized BLEU (`evaluation.score_translations`), and writes the
translations and an `eval-DATA-SPLIT.json` report into the run directory.
"""

import dataclasses
import os
import time

from keras_transformer.data.corpora import load_corpus
from keras_transformer.decoding import policy
from keras_transformer.decoding.translator import Translator
from keras_transformer.evaluation import Scores, score_translations
from keras_transformer.training.run_directory import load_run_models
from keras_transformer.utils.files import atomic_write


@dataclasses.dataclass
class Evaluation:
    """What `evaluate_run` measured and where it wrote it."""

    scores: Scores
    sentences: int
    seconds: float
    translations_path: str
    report_path: str
    report: dict


def evaluate_run(
    model,
    data,
    split="test",
    data_dir=None,
    source_lang=None,
    target_lang=None,
    limit=None,
    output=None,
    beam_size=policy.BEAM_SIZE,
    length_penalty=policy.LENGTH_PENALTY,
    batch_size=64,
    progress=None,
    checkpoint=None,
):
    """Translates and scores `data`'s `split` with a run's model.

    Args:
        model: a run directory (its `model.keras`) or a `.keras` file inside one; a list of
            them: their `Ensemble` (the report and translations go to the first one's run).
        data, data_dir: the corpus (`load_corpus`).
        split: `train`, `val` or `test`.
        source_lang, target_lang: default: the run's.
        limit: only the first N sentences.
        output: the translations file (default `RUN/translations-DATA-SPLIT.txt`).
        beam_size, length_penalty, batch_size: of the `Translator`.
        progress: called with `(sentences done, sentences)` after every batch.
        checkpoint: an epoch: its checkpoint in the run (`model` a run directory) instead of the
            model file.

    Returns:
        an `Evaluation`.
    """
    if not isinstance(model, (str, os.PathLike)) and len(model) == 1:
        model = model[0]
    run, loaded = load_run_models(model, checkpoint)
    translator = Translator(
        loaded,
        run.tokenizer(),
        beam_size=beam_size,
        length_penalty=length_penalty,
        batch_size=batch_size,
    )
    settings = run.settings()
    source_lang = source_lang or settings.get("source_lang", "en")
    target_lang = target_lang or settings.get("target_lang", "de")
    sources, references = load_corpus(data, data_dir, source_lang, target_lang)[split]
    if limit:
        sources, references = sources[:limit], references[:limit]
    if progress is not None:
        progress(0, len(sources))  # the total, also for an empty split
    start = time.perf_counter()
    hypotheses, _ = translator.translate(
        sources, None if progress is None else (lambda done: progress(done, len(sources)))
    )
    seconds = time.perf_counter() - start
    scores = score_translations(hypotheses, references, target_lang)
    name = f"{data.split(':')[0]}-{split}"
    output = output or str(run.path / f"translations-{name}.txt")
    atomic_write(output, "".join(f"{line}\n" for line in hypotheses))
    report = {
        "model": str(model) if isinstance(model, (str, os.PathLike)) else [str(m) for m in model],
        "data": data,
        "split": split,
        "sentences": len(sources),
        "beam_size": beam_size,
        "length_penalty": length_penalty,
        "bleu": scores.bleu,
        "bleu_signature": scores.bleu_signature,
        "chrf": scores.chrf,
        "chrf_signature": scores.chrf_signature,
        "paper_bleu": scores.paper_bleu,
        "paper_signature": scores.paper_signature,
        "seconds": round(seconds, 1),
    }
    report_path = str(run.path / f"eval-{name}.json")
    run.write_json(report_path, report)
    return Evaluation(scores, len(sources), seconds, output, report_path, report)

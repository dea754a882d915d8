"""Translation quality with sacreBLEU and chrF, reported with their signatures
(the signature says how the score was computed: tokenizer, casing, smoothing,
version; a BLEU number without it cannot be compared).

Beside them, the "paper metric" that the Multi30k literature reports
(multi-bleu on lowercased, Moses-tokenized text): hypotheses and references
are lowercased, Moses punctuation-normalized and Moses-tokenized (sacremoses,
escaping off) for the target language, and scored by sacreBLEU with
`tokenize="none"`. It needs `sacremoses` (`pip install sacremoses`, in the
`test` and `metrics` extras); without it the paper metric is left out.
"""

import dataclasses

import sacrebleu

PAPER_METRIC = "lowercased, Moses punct-normalized + tokenized (sacremoses {version}, {lang}), tok:none"


@dataclasses.dataclass
class Scores:
    bleu: float
    bleu_signature: str
    chrf: float
    chrf_signature: str
    paper_bleu: float = None  # None when not asked for or sacremoses is missing
    paper_signature: str = None

    def __str__(self):
        text = f"BLEU {self.bleu:.2f} ({self.bleu_signature})\nchrF {self.chrf:.2f} ({self.chrf_signature})"
        if self.paper_bleu is not None:
            text += f"\npaper BLEU {self.paper_bleu:.2f} ({self.paper_signature})"
        return text


def moses_available():
    try:
        import sacremoses  # noqa: F401
    except ImportError:
        return False
    return True


def paper_bleu(hypotheses, references, lang):
    """`(BLEU, description)` on lowercased, Moses-normalized and -tokenized text (see above).

    >>> round(paper_bleu(["Ein Hund läuft."], ["ein hund läuft ."], "de")[0], 1)
    100.0
    """
    import sacremoses

    normalizer, tokenizer = sacremoses.MosesPunctNormalizer(lang), sacremoses.MosesTokenizer(lang)

    def process(text):
        return tokenizer.tokenize(normalizer.normalize(text.lower()), return_str=True, escape=False)

    bleu = sacrebleu.metrics.BLEU(tokenize="none", force=True)  # the text is tokenized on purpose
    score = bleu.corpus_score([process(h) for h in hypotheses], [[process(r) for r in references]])
    version = getattr(sacremoses, "__version__", "")
    return score.score, PAPER_METRIC.format(version=version, lang=lang) + f", {bleu.get_signature()}"


def score_translations(hypotheses, references, target_lang=None):
    """Corpus sacreBLEU (13a tokenization, mixed case, exp smoothing) and chrF;
    with `target_lang` (and sacremoses installed) also the paper metric.

    Args:
        hypotheses: list of detokenized system outputs.
        references: list of detokenized references, aligned with `hypotheses`.
        target_lang: the language code for the Moses tokenizer ("de").

    Example:
    >>> round(score_translations(["a cat sat on the mat"], ["a cat sat on the mat"]).bleu, 2)
    100.0
    """
    hypotheses, references = list(hypotheses), list(references)
    if len(hypotheses) != len(references):
        raise ValueError(
            f"{len(hypotheses)} hypotheses but {len(references)} references; "
            f"they must be aligned line by line."
        )
    if not hypotheses:
        raise ValueError("Nothing to score: no hypotheses.")
    bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    bleu_score = bleu.corpus_score(hypotheses, [references])
    chrf_score = chrf.corpus_score(hypotheses, [references])
    scores = Scores(bleu_score.score, str(bleu.get_signature()), chrf_score.score, str(chrf.get_signature()))
    if target_lang and moses_available():
        scores.paper_bleu, scores.paper_signature = paper_bleu(hypotheses, references, target_lang)
    return scores

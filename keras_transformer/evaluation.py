"""Translation quality with sacreBLEU and chrF, reported with their signatures
(the signature says how the score was computed: tokenizer, casing, smoothing,
version; a BLEU number without it cannot be compared)."""

import dataclasses

import sacrebleu


@dataclasses.dataclass
class Scores:
    bleu: float
    bleu_signature: str
    chrf: float
    chrf_signature: str

    def __str__(self):
        return (f"BLEU {self.bleu:.2f} ({self.bleu_signature})\n"
                f"chrF {self.chrf:.2f} ({self.chrf_signature})")


def score_translations(hypotheses, references):
    """Corpus sacreBLEU (13a tokenization, mixed case, exp smoothing) and chrF.

    Args:
        hypotheses: list of detokenized system outputs.
        references: list of detokenized references, aligned with `hypotheses`.

    Example:
    >>> round(score_translations(["a cat sat on the mat"], ["a cat sat on the mat"]).bleu, 2)
    100.0
    """
    hypotheses, references = list(hypotheses), list(references)
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references; "
                         f"they must be aligned line by line.")
    if not hypotheses:
        raise ValueError("Nothing to score: no hypotheses.")
    bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    bleu_score = bleu.corpus_score(hypotheses, [references])
    chrf_score = chrf.corpus_score(hypotheses, [references])
    return Scores(bleu_score.score, str(bleu.get_signature()), chrf_score.score,
                  str(chrf.get_signature()))

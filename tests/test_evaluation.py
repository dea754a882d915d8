import pytest
import sacrebleu

from keras_transformer.evaluation import score_translations


def test_scores_match_sacrebleu_and_carry_signatures():
    hypotheses = ["The cat sat on a mat.", "A dog runs in the park", "Hello"]
    references = ["The cat sat on the mat.", "A dog is running in the park.", "Hello world"]
    scores = score_translations(hypotheses, references)
    assert scores.bleu == pytest.approx(sacrebleu.corpus_bleu(hypotheses, [references]).score)
    assert scores.chrf == pytest.approx(sacrebleu.corpus_chrf(hypotheses, [references]).score)
    assert 0 < scores.bleu < 100
    assert "tok:13a" in scores.bleu_signature and "case:mixed" in scores.bleu_signature
    assert f"version:{sacrebleu.__version__}" in scores.bleu_signature
    assert "chrF" in str(scores) and "nrefs:1" in scores.chrf_signature


def test_misaligned_or_empty_input_is_reported():
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        score_translations(["a", "b"], ["a"])
    with pytest.raises(ValueError, match="no hypotheses"):
        score_translations([], [])

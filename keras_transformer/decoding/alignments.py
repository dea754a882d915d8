"""Alignments as words: from the searches' token-level alignments to Pharaoh `i-j` pairs.

The searches return, for each output token before EOS, the source position
(a SentencePiece token of the source, EOS included) it attends to most
(`keras_transformer.decoding.request.align`). Users align words: a piece that
starts with `▁` begins a word, the others continue it, so these pairs are of
the indices of the space-separated words of the (normalized) source and
translation. Source EOS and padding belong to no word. No dependencies (the
TensorFlow-free ONNX Runtime driver uses it too).
"""

WORD_START = "\u2581"


def word_indices(pieces):
    """The word index of each piece (`-1` for the special pieces): a new word at every piece
    that starts with `▁`, and at the first piece."""
    indices, word = [], -1
    for piece in pieces:
        if piece in ("<pad>", "<s>", "</s>"):
            indices.append(-1)
            continue
        if piece.startswith(WORD_START) or word < 0:
            word += 1
        indices.append(word)
    return indices


def word_alignment(source_pieces, target_pieces, token_alignment):
    """Sorted unique `(source word, target word)` pairs from a hypothesis's token alignment.

    Args:
        source_pieces: the source's pieces (without EOS: it aligns to no word).
        target_pieces: the hypothesis's pieces, position by position (EOS and padding
            after it included or not).
        token_alignment: per target position, the attended source position, or -1.
    """
    source_words, target_words = word_indices(source_pieces), word_indices(target_pieces)
    pairs = set()
    for position, attended in enumerate(token_alignment):
        if position >= len(target_words) or attended < 0 or attended >= len(source_words):
            continue
        if target_words[position] >= 0 and source_words[attended] >= 0:
            pairs.add((source_words[attended], target_words[position]))
    return sorted(pairs)


def pharaoh(pairs):
    """`"0-0 1-2 ..."` of `(i, j)` pairs."""
    return " ".join(f"{i}-{j}" for i, j in pairs)

"""The special token ids of every vocabulary the project makes (SentencePiece's pieces 0-3):
padding, unknown, BOS and EOS. A module of their own so that reading token ids (`token_store`)
needs neither TensorFlow nor SentencePiece; `tokenizer` re-exports them."""

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3  # UNK_ID: also decoding.policy's (a test pins them)

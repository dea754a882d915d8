"""`TransformerConfig`: every hyper-parameter of the model, and the presets.

Presets follow Table 3 of the paper for `base` and `big`; `small` and `tiny`
are CPU-sized. Parameter counts with a shared 37k vocabulary (three-way tied
embeddings, biases in every projection, no bias on the tied output):
base 63,082,496 and big 214,245,376 (the paper rounds to 65M and 213M).
"""

import dataclasses
import difflib

from keras_transformer.layers.multi_head_attention import ATTENTION_MODES
from keras_transformer.utils.checks import check_choice, check_positive_int, check_rate

PRESETS = {
    # Table 3, row "base": N=6, d_model=512, d_ff=2048, h=8, P_drop=0.1.
    "base": dict(num_layers=6, d_model=512, num_heads=8, d_ff=2048, dropout_rate=0.1, max_length=512),
    # Table 3, row "big": N=6, d_model=1024, d_ff=4096, h=16, P_drop=0.3.
    "big": dict(num_layers=6, d_model=1024, num_heads=16, d_ff=4096, dropout_rate=0.3, max_length=512),
    # CPU work (Multi30k, the demo): about 7.5M parameters with an 8k vocabulary.
    "small": dict(num_layers=3, d_model=256, num_heads=4, d_ff=1024, dropout_rate=0.1, max_length=256),
    # Small corpora (Multi30k's 29k pairs) on a CPU: Transformer-Tiny (Wu et al. 2021),
    # about 2.3M parameters with an 8k vocabulary, ~1/3 of `small`'s FLOPs per token.
    "mini": dict(num_layers=4, d_model=128, num_heads=4, d_ff=256, dropout_rate=0.3, max_length=256),
    # Tests and toy tasks.
    "tiny": dict(num_layers=2, d_model=64, num_heads=4, d_ff=256, dropout_rate=0.1, max_length=128),
}


def check_fields(values):
    """Raises a ValueError naming each unknown key of `values`, with the close field names and the
    list of all fields."""
    fields = [field.name for field in dataclasses.fields(TransformerConfig)]
    unknown = [key for key in values if key not in fields]
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, fields, 1)
            hints.append(f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key))
        raise ValueError(
            f"unknown TransformerConfig field {', '.join(hints)}; the fields are: {', '.join(fields)}."
        )


@dataclasses.dataclass
class TransformerConfig:
    """Hyper-parameters of `Transformer` (names as in the paper).

    Args:
        vocab_size: size of the (shared) vocabulary, or of the source
            vocabulary when `target_vocab_size` is given.
        num_layers: encoder layers N.
        num_decoder_layers: decoder layers (defaults to `num_layers`).
        d_model, num_heads, d_ff: widths and heads.
        dropout_rate: P_drop on sublayer outputs and embedding sums (§5.4).
        attention_dropout_rate: dropout on attention weights (0 in the paper).
        activation_dropout_rate: dropout inside the feed-forward (0 in the paper).
        layer_norm_epsilon: 1e-6.
        norm_first: pre-norm instead of the paper's post-norm.
        max_length: longest source or target sequence (positional table size,
            decoding cache size).
        target_vocab_size: a separate target vocabulary (implies untied
            source/target embeddings).
        share_embeddings: one matrix for source and target embeddings (§3.4;
            needs a shared vocabulary).
        tie_output: the pre-softmax projection uses the target embedding
            matrix (§3.4); otherwise a separate `Dense(vocab)` with bias.
        attention_mode: `"batched"` or `"per_head"`.
        pad_id, bos_id, eos_id: special token ids.
    """

    vocab_size: int
    num_layers: int = 6
    num_decoder_layers: int = None
    d_model: int = 512
    num_heads: int = 8
    d_ff: int = 2048
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.0
    activation_dropout_rate: float = 0.0
    layer_norm_epsilon: float = 1e-6
    norm_first: bool = False
    max_length: int = 512
    target_vocab_size: int = None
    share_embeddings: bool = True
    tie_output: bool = True
    attention_mode: str = "batched"
    pad_id: int = 0
    bos_id: int = 2
    eos_id: int = 3

    def __post_init__(self):
        # Fields left to default from another field; `to_dict` gives them back as None, so an override
        # of the field they follow (`replace(num_layers=3)`) re-derives them.
        self._derived = ()
        if self.num_decoder_layers is None:
            self.num_decoder_layers = self.num_layers
            self._derived = ("num_decoder_layers",)
        for name in (
            "vocab_size",
            "num_layers",
            "num_decoder_layers",
            "d_model",
            "num_heads",
            "d_ff",
            "max_length",
        ):
            check_positive_int(name, getattr(self, name))
        if self.target_vocab_size is not None:
            check_positive_int("target_vocab_size", self.target_vocab_size)
        for name in ("dropout_rate", "attention_dropout_rate", "activation_dropout_rate"):
            check_rate(name, getattr(self, name))
        if self.d_model % self.num_heads:
            divisors = [h for h in range(1, min(self.d_model, 64) + 1) if self.d_model % h == 0]
            raise ValueError(
                f"d_model={self.d_model} must be divisible by num_heads={self.num_heads}; "
                f"allowed num_heads for this d_model: {divisors}."
            )
        check_choice("attention_mode", self.attention_mode, ATTENTION_MODES)
        if self.share_embeddings and self.target_vocab_size not in (None, self.vocab_size):
            raise ValueError(
                f"share_embeddings=True needs one vocabulary, but vocab_size={self.vocab_size} "
                f"and target_vocab_size={self.target_vocab_size}; pass share_embeddings=False "
                f"or drop target_vocab_size."
            )
        for name in ("pad_id", "bos_id", "eos_id"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value < min(self.vocab_size, self.target_vocab):
                raise ValueError(
                    f"{name} must be an id in [0, {min(self.vocab_size, self.target_vocab)}); got {value!r}."
                )

    @property
    def target_vocab(self):
        """Size of the target vocabulary (the logits' last dimension)."""
        return self.target_vocab_size or self.vocab_size

    @classmethod
    def from_preset(cls, name, **overrides):
        """The preset `name` (`tiny`, `small`, `base`, `big`) with `overrides` applied.

        Example:
        >>> TransformerConfig.from_preset("base", vocab_size=37000).d_ff
        2048
        """
        check_choice("preset", name, tuple(PRESETS))
        check_fields(overrides)
        if "vocab_size" not in overrides:
            raise ValueError(f"from_preset({name!r}) needs vocab_size=... (the vocabulary size).")
        return cls(**{**PRESETS[name], **overrides})

    def to_dict(self):
        """The fields as given: one left to default from another (`num_decoder_layers`) is None.

        Example:
        >>> TransformerConfig.from_preset("tiny", vocab_size=100).to_dict()["num_decoder_layers"] is None
        True
        """
        values = dataclasses.asdict(self)
        values.update(dict.fromkeys(self._derived))
        return values

    @classmethod
    def from_dict(cls, values):
        """The config of `to_dict`'s dictionary; an unknown key is an error that lists the fields."""
        check_fields(values)
        return cls(**values)

    def replace(self, **changes):
        """A copy with `changes`; a field that defaulted from another follows it again (use this, not
        `dataclasses.replace`, which copies the derived value).

        Example:
        >>> config = TransformerConfig.from_preset("mini", vocab_size=100)
        >>> config.replace(num_layers=3).num_decoder_layers
        3
        """
        return type(self).from_dict({**self.to_dict(), **changes})

    def layer_arguments(self):
        """The arguments that `Encoder`/`Decoder` take besides `num_layers`."""
        return dict(
            d_model=self.d_model,
            num_heads=self.num_heads,
            d_ff=self.d_ff,
            max_length=self.max_length,
            dropout_rate=self.dropout_rate,
            attention_dropout_rate=self.attention_dropout_rate,
            activation_dropout_rate=self.activation_dropout_rate,
            layer_norm_epsilon=self.layer_norm_epsilon,
            norm_first=self.norm_first,
            attention_mode=self.attention_mode,
        )

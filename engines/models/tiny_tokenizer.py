"""A character-level tokenizer built offline (no hub) for tiny test models: one token per printable char.

Non-goal: being a good tokenizer; it only has to round-trip ASCII text and digits.
"""

from __future__ import annotations

import string
from typing import Any

SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")


def build_char_tokenizer(vocab_size: int = 512) -> Any:
    """A `PreTrainedTokenizerFast` over specials + printable ASCII; ids stay below `vocab_size`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(list(SPECIALS) + chars)}
    if len(vocab) > vocab_size:
        raise ValueError(f"tiny tokenizer needs vocab_size >= {len(vocab)}, got {vocab_size}")
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tok.padding_side = "left"
    return tok

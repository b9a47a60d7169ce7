"""A byte-level tokenizer that needs no download.

Ids 0..255 are the UTF-8 bytes, 256 is ``<eod>`` and 257 is ``<pad>``. Megatron-Core's own
``ByteLevelTokenizer`` puts EOS/PAD on ids 0 and 1, which collide with real bytes, so
``GPTDataset`` could neither tell a padded position from a NUL byte nor mask it; this one keeps
the special ids outside the byte range.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import numpy as np
from megatron.core.tokenizers import MegatronTokenizerBase

__all__ = ["ByteTokenizer"]

_NUM_BYTES = 256
_EOD_ID = 256
_PAD_ID = 257
_VOCAB_SIZE = 258
_SPECIAL_TOKENS = {"<eod>": _EOD_ID, "<pad>": _PAD_ID}


class ByteTokenizer(MegatronTokenizerBase):
    """UTF-8 byte tokenizer with ``<eod>`` = 256 and ``<pad>`` = 257 (``vocab_size`` 258).

    Subclasses ``megatron.core.tokenizers.MegatronTokenizerBase``, the type
    ``GPTDatasetConfig.tokenizer`` is annotated with in megatron-core 0.16.1, and offers the
    attributes ``GPTDataset`` reads: ``vocab_size``, ``eod``, ``pad`` and ``unique_identifiers``
    (hashed into the dataset cache file names).
    """

    def __init__(self) -> None:
        super().__init__(path="", config={})

    # --------------------------------------------------------------------- encoding

    def tokenize(self, text: str) -> list[int]:
        """Encode text as its UTF-8 bytes.

        Args:
            text: The text to encode.

        Returns:
            One id per UTF-8 byte, each in ``[0, 256)``.
        """
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Iterable[int] | np.ndarray) -> str:
        """Decode ids back to text, dropping special ids.

        Args:
            ids: Token ids (list, numpy array or 1-D tensor).

        Returns:
            The decoded text; invalid UTF-8 sequences become U+FFFD.
        """
        flat = np.asarray(ids).reshape(-1).tolist()
        data = bytes(i for i in flat if 0 <= i < _NUM_BYTES)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        """Not supported: a byte tokenizer has no chat template."""
        raise NotImplementedError("ByteTokenizer has no chat template")

    # --------------------------------------------------------------------- special ids

    @property
    def vocab_size(self) -> int:
        """Number of ids: 256 bytes plus ``<eod>`` and ``<pad>``."""
        return _VOCAB_SIZE

    @property
    def eod(self) -> int:
        """End-of-document id (256)."""
        return _EOD_ID

    @property
    def eod_id(self) -> int:
        """Alias of :attr:`eod`."""
        return _EOD_ID

    @property
    def eos(self) -> int:
        """End-of-sequence id; the same as :attr:`eod` (Megatron checks pad against it)."""
        return _EOD_ID

    @property
    def eos_id(self) -> int:
        """Alias of :attr:`eos`."""
        return _EOD_ID

    @property
    def pad(self) -> int:
        """Padding id (257)."""
        return _PAD_ID

    @property
    def pad_id(self) -> int:
        """Alias of :attr:`pad`."""
        return _PAD_ID

    @property
    def special_tokens(self) -> dict[str, int]:
        """Special token names and their ids."""
        return dict(_SPECIAL_TOKENS)

    # --------------------------------------------------------------------- vocab

    @property
    def vocab(self) -> dict[str, int]:
        """Token text to id; bytes are spelled ``<0xNN>``."""
        table = {f"<0x{b:02X}>": b for b in range(_NUM_BYTES)}
        table.update(_SPECIAL_TOKENS)
        return table

    @property
    def inv_vocab(self) -> dict[int, str]:
        """Id to token text (the inverse of :attr:`vocab`)."""
        return {i: t for t, i in self.vocab.items()}

    @property
    def unique_identifiers(self) -> OrderedDict[str, Any]:
        """What makes this tokenizer unique; Megatron hashes it into its index cache names."""
        return OrderedDict(
            [
                ("class", f"{type(self).__module__}.{type(self).__qualname__}"),
                ("vocab_size", _VOCAB_SIZE),
                ("eod", _EOD_ID),
                ("pad", _PAD_ID),
            ]
        )

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={_VOCAB_SIZE}, eod={_EOD_ID}, pad={_PAD_ID})"

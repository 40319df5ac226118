"""Data: the token file format, tokenizers, the synthetic recall task, the loader.

The token file and tokenizer names are light (numpy); the torch-backed ones (batches, the
loader, the recall tasks) are imported on first use, so `loongtrain prepare` and its worker
processes do not pay for torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loongtrain._lazy import lazy_attributes
from loongtrain.data.tokenizer import check_same_tokenizer, folder_tokenizer_fingerprint, tokenizer_fingerprint
from loongtrain.data.tokens import TokenFile, TokenFileError, write_tokens

_LAZY = {
    "Microbatch": "loongtrain.data.batch",
    "BatchLoader": "loongtrain.data.loader",
    "TokenFileSource": "loongtrain.data.loader",
    "LengthGroupedSource": "loongtrain.data.loader",
    "MixtureSource": "loongtrain.data.mixture",
    "UpsampledSource": "loongtrain.data.mixture",
    "IGNORE_INDEX": "loongtrain.data.recall",
    "PackedRecallTask": "loongtrain.data.recall",
    "RecallTask": "loongtrain.data.recall",
}

__all__ = [
    "IGNORE_INDEX",
    "BatchLoader",
    "LengthGroupedSource",
    "Microbatch",
    "MixtureSource",
    "PackedRecallTask",
    "RecallTask",
    "TokenFile",
    "TokenFileError",
    "TokenFileSource",
    "UpsampledSource",
    "check_same_tokenizer",
    "folder_tokenizer_fingerprint",
    "tokenizer_fingerprint",
    "write_tokens",
]

__getattr__ = lazy_attributes(__name__, _LAZY)


if TYPE_CHECKING:
    from loongtrain.data.batch import Microbatch
    from loongtrain.data.loader import BatchLoader, LengthGroupedSource, TokenFileSource
    from loongtrain.data.mixture import MixtureSource, UpsampledSource
    from loongtrain.data.recall import IGNORE_INDEX, PackedRecallTask, RecallTask

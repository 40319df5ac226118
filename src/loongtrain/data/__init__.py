"""Data: the token file format, tokenizers, the synthetic recall task, the loader."""

from loongtrain.data.loader import BatchLoader, TokenFileSource
from loongtrain.data.recall import IGNORE_INDEX, RecallTask
from loongtrain.data.tokens import TokenFile, TokenFileError, write_tokens

__all__ = [
    "IGNORE_INDEX",
    "BatchLoader",
    "RecallTask",
    "TokenFile",
    "TokenFileError",
    "TokenFileSource",
    "write_tokens",
]

"""Data: the token file format, tokenizers, the synthetic recall task, the loader."""

from loongtrain.data.batch import Microbatch
from loongtrain.data.loader import BatchLoader, TokenFileSource
from loongtrain.data.recall import IGNORE_INDEX, PackedRecallTask, RecallTask
from loongtrain.data.tokenizer import check_same_tokenizer, folder_tokenizer_fingerprint, tokenizer_fingerprint
from loongtrain.data.tokens import TokenFile, TokenFileError, write_tokens

__all__ = [
    "IGNORE_INDEX",
    "BatchLoader",
    "Microbatch",
    "PackedRecallTask",
    "RecallTask",
    "TokenFile",
    "TokenFileError",
    "TokenFileSource",
    "check_same_tokenizer",
    "folder_tokenizer_fingerprint",
    "tokenizer_fingerprint",
    "write_tokens",
]

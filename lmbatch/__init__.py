"""lmbatch: offline batch evaluation of LM programs, executed in DFS order over a radix tree."""

import os
import threading

if os.environ.get("LMBATCH_KEEP_BYTECODE"):     # a process the command started: its bytecode kept as the command's
    from lmbatch.cache import keep_bytecode

    keep_bytecode()

__version__ = "0.1.0"

# A run imports torch and transformers on its model thread while its main thread may import xgrammar
# or build a transformers tokenizer, both of which import transformers too; two threads importing
# the same package's submodules can each find the other's half-initialized and fail ("cannot import
# name 'PreTrainedTokenizerBase' from 'transformers'"). Those imports take this lock, one at a time.
IMPORT_LOCK = threading.RLock()

"""The experiment's data: corpus and splits, tokenizers, the encoded dataset
and its batches, as in nanoGPT's ``shakespeare_char``.

One text is split into training, validation and (optionally) test text
(:mod:`.corpus`), tokenized by characters or byte-level BPE
(:mod:`.tokenization`), encoded once into token arrays cached in the run's
workdir (:mod:`.dataset`), and cut into windows (:mod:`.batches`): random
ones for training, a pure function of ``(seed, step)``; fixed ones for
evaluation. The names below are the package's API:
``from lmhead.lm import data`` then ``data.load_dataset(config.data, workdir)``
(or, for runs sharing one tokenizer, ``data.train_tokenizer(config.data)`` once
and ``data.load_dataset(config.data, workdir, tokenizer)`` for each).
"""

from lmhead.lm.data.batches import (
    TRAIN_STREAM,
    eval_batches,
    label_chars,
    train_batch,
    windows,
)
from lmhead.lm.data.corpus import (
    CORPUS_PACKAGE_INSTALL,
    SPLITS,
    Splits,
    assign_works,
    cut_at,
    join_works,
    load_text,
    read_splits,
    shakespeare_text,
    shakespeare_works,
    split_blocks,
    split_text,
    split_works,
    text_prefix,
)
from lmhead.lm.data.dataset import (
    TOKENIZER_FILE,
    TOKENS_FILE,
    Dataset,
    load_dataset,
    load_test_tokens,
    tokenizer_vocab_size,
    train_tokenizer,
)
from lmhead.lm.data.tokenization import (
    END_OF_TEXT,
    BPETokenizer,
    CharTokenizer,
    Tokenizer,
    load_tokenizer,
    make_tokenizer,
    text_length,
    token_bytes,
)

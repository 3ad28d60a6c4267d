"""The language model and its data: LSTMLM as named layers, positional dropout, the corpus reader
(streaming, cached), the embedded synthetic corpus, and bucketed (T, B) batches. Imports runtime."""
from . import dropout, synthetic
from .bucketing import Batch, BucketIterator, StreamIterator, check_sizes, default_buckets, padding_fraction
from .data import Corpus, Vocabulary, load_corpus, read_sentences
from .dropout import Position, PositionalDropout, keep_mask
from .model import CONFIGS, LSTMLM, LMConfig, detach_state, nll_sum
from .reading import EOS, PAD, UNK, CorpusError
from .sentences import Sentences

__all__ = [
    "Batch", "BucketIterator", "CONFIGS", "Corpus", "CorpusError", "EOS", "LMConfig", "LSTMLM", "PAD",
    "Position", "PositionalDropout", "Sentences", "StreamIterator", "UNK", "Vocabulary", "check_sizes",
    "default_buckets", "detach_state", "dropout", "keep_mask", "load_corpus", "nll_sum", "padding_fraction",
    "read_sentences", "synthetic",
]

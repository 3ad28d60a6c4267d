"""The language model and its data: LSTMLM as named layers, positional dropout, the corpus reader,
the embedded synthetic corpus, and bucketed (T, B) batches. Imports runtime."""
from . import dropout, synthetic
from .bucketing import Batch, BucketIterator, StreamIterator, default_buckets, padding_fraction
from .data import EOS, PAD, UNK, Corpus, CorpusError, Vocabulary, load_corpus, read_sentences
from .dropout import Position, PositionalDropout, keep_mask
from .model import CONFIGS, LSTMLM, LMConfig, detach_state, nll_sum

__all__ = [
    "Batch", "BucketIterator", "CONFIGS", "Corpus", "CorpusError", "EOS", "LMConfig", "LSTMLM", "PAD",
    "Position", "PositionalDropout", "StreamIterator", "UNK", "Vocabulary", "default_buckets",
    "detach_state", "dropout", "keep_mask", "load_corpus", "nll_sum", "padding_fraction",
    "read_sentences", "synthetic",
]

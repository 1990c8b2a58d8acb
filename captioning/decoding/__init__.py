"""Decoding algorithms shared by every architecture (greedy, group-aware beam search, sampling)."""

from captioning.decoding.search import beam_search, greedy, sample, to_words, word_ids
from captioning.decoding.steps import Decoded

__all__ = ["Decoded", "beam_search", "greedy", "sample", "to_words", "word_ids"]

"""Decoding algorithms shared by every architecture (greedy, group-aware beam search, sampling)."""

from captioning.decoding.search import Decoded, beam_search, greedy, sample, to_words, word_ids

__all__ = ["Decoded", "beam_search", "greedy", "sample", "to_words", "word_ids"]

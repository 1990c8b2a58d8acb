"""Repetition statistics of generated captions (distinct captions, immediate word repetitions)."""

import pytest

from captioning.metrics.diversity import repetition_stats


def test_repetition_stats_counts_immediate_repeats_only():
    captions = [
        "on the beach beach",        # 1 repeated word of 4
        "in field field field",      # 2 of 4
        "a man and a dog",           # "a" comes back, but not right after itself: 0 of 5
        "On the  beach Beach.",      # the first caption again after normalisation (case, spaces); 1 of 4
    ]
    stats = repetition_stats(captions)
    assert stats == {
        "captions": 4,
        "distinct_captions": 4,          # "beach." differs from "beach" as a caption (normalisation keeps it)
        "distinct_fraction": 1.0,
        "repeat_caption_fraction": 0.75,
        "repeated_token_rate": pytest.approx(4 / 17),
    }


def test_repetition_stats_distinct_and_clean():
    stats = repetition_stats(["a red circle", "A  red circle", "a blue square", ""])
    assert stats["distinct_captions"] == 3 and stats["distinct_fraction"] == 0.75
    assert stats["repeat_caption_fraction"] == 0.0 and stats["repeated_token_rate"] == 0.0
    assert repetition_stats([""])["repeated_token_rate"] == 0.0  # no words at all
    with pytest.raises(ValueError):
        repetition_stats([])

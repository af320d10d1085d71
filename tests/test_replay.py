"""The replayed estimate's draft schedule: rounds over an answer, and over only the tokens a decode generates."""
from __future__ import annotations

import torch

from draftline.drafter.replay import decode_rounds, resampled_interval, replayed_summary


def test_a_replay_limited_to_the_decoded_length_counts_only_those_rounds():
    # One drafted token per round, always right: each round accepts it plus the target's own token (2 tokens a round).
    k, t, answer = 1, 40, 5
    hit = torch.ones(k, t, dtype=torch.bool)
    lossable = torch.ones(k, t, dtype=torch.bool)
    whole = decode_rounds(hit, lossable, answer)
    assert whole == [1] * 17  # rounds drafting at slots 4, 6, ..., 36: every round's draft needs its next token in view
    # A decode of 12 new tokens: the prefill's token, then 2 a round; the last rounds must not come from beyond them.
    short = decode_rounds(hit, lossable, answer, limit=12)
    assert short == [1] * 6
    # Where the answer's later tokens are easy and its first ones hard, only the limit keeps the estimate to the start.
    hit[:, answer - 1 + 12:] = True
    hit[:, : answer - 1 + 12] = False
    assert sum(decode_rounds(hit, lossable, answer)) > 0
    assert sum(decode_rounds(hit, lossable, answer, limit=12)) == 0


def test_the_estimates_spread_grows_as_its_sequences_disagree_and_vanishes_when_they_agree():
    # (rounds, accepted draft tokens) per validation sequence: alike, then one easy and one hard answer per pair.
    alike = [(10, 12)] * 20
    assert resampled_interval(alike) == [2.2, 2.2]
    mixed = [(10, 24), (10, 0)] * 10  # the same pooled figure, 2.2, from answers 3.4 and 1.0
    lo, hi = resampled_interval(mixed)
    assert lo < 2.2 < hi and hi - lo > 0.3
    # Four times the sequences, half the spread (the square root law), within the draws' own noise.
    lo4, hi4 = resampled_interval(mixed * 4)
    assert 0.4 < (hi4 - lo4) / (hi - lo) < 0.6
    assert resampled_interval([(0, 0)]) is None


def test_the_training_log_states_the_replay_with_its_spread():
    replayed = {"acceptance_length": 2.2, "sequences": 20, "interval_by_k": [[1.9, 2.0], [2.05, 2.35]]}
    assert replayed_summary(replayed) == ", replayed as decoding drafts 2.200 (2.050-2.350 over its 20 sequences resampled)"
    assert replayed_summary({}) == ""

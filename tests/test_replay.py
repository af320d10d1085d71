"""The replayed estimate's draft schedule: rounds over an answer, and over only the tokens a decode generates."""
from __future__ import annotations

import torch

from draftline.drafter.replay import decode_rounds


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

"""The n-gram proposer (prompt lookup): drafts what followed the last time the sequence's latest
tokens appeared in its own tokens, prompt and output.

It looks for the longest suffix of ``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens that
occurred earlier, takes its most recent earlier occurrence (code being edited repeats what it just
said), and proposes up to ``k`` tokens that followed it. Drafts are deterministic: no draft
distribution, which verification reads as one-hot on the draft.
"""

from __future__ import annotations

import numpy as np

from ..families.spec import DraftRequest, Drafts, SpecProposer


def lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest suffix
    of ``tokens`` of ``min_n`` to ``max_n`` tokens; none where no such suffix occurred."""
    last = len(tokens) - 1
    if k <= 0 or last < min_n:
        return []
    a = np.asarray(tokens)
    ends = np.flatnonzero(a[:last] == a[last])  # where a match of the last token ends
    n = 1
    while n < max_n and ends.size:  # keep the ends whose match is one token longer
        longer = ends[ends >= n]
        longer = longer[a[longer - n] == a[last - n]]
        if not longer.size:
            break
        ends, n = longer, n + 1
    if n < min_n or not ends.size:
        return []
    start = int(ends[-1]) + 1
    return a[start:start + k].tolist()


class NgramProposer(SpecProposer):
    name = "ngram"

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        spec = ctx.engine_config.speculative_config
        self.min_n, self.max_n = spec.prompt_lookup_min, spec.prompt_lookup_max

    def propose(self, requests: list[DraftRequest], features=None) -> Drafts:
        return Drafts([lookup(r.token_ids, self.min_n, self.max_n, r.k) for r in requests])

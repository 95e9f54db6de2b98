"""Each sequence's drafts, step by step, as an engine's speculator proposes them: for tests that
compare one engine's drafts with another's."""

from __future__ import annotations

from engine.core.engine import EngineCore


class Drafts:
    """Records each sequence's drafts, step by step, keyed by (request id, index)."""

    def __init__(self, engine: EngineCore) -> None:
        self.speculator, self.by_seq = engine.speculator, {}

    def __enter__(self) -> Drafts:
        propose = self.speculator.propose

        def spied(seqs, budget):
            drafts = propose(seqs, budget)
            for s in seqs:
                if drafts.get(s.seq_id):
                    self.by_seq.setdefault((s.request_id, s.index), []).append(drafts[s.seq_id])
            return drafts
        self.speculator.propose = spied
        return self

    def __exit__(self, *exc) -> None:
        del self.speculator.propose

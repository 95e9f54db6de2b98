"""Speculative decoding: its configuration, the proposers the core ships (registered through the
spec family like any plugin's), and the verification of drafts in the engine's step."""

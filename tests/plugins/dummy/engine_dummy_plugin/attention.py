"""The dummy attention backend: the native computation under its own name."""

from __future__ import annotations

from engine.core.native.attention import NativeAttention


class DummyAttention(NativeAttention):
    name = "dummy-fast"

"""Paged KV cache: page ids and their references, the radix prefix cache, the KV tensors."""

from .pages import OutOfPages, PagePool
from .radix import PrefixMatch, RadixCache, RadixStats
from .storage import KVCache, KVLayerSpec, pages_for_budget

__all__ = ["KVCache", "KVLayerSpec", "OutOfPages", "PagePool", "PrefixMatch", "RadixCache", "RadixStats",
           "pages_for_budget"]

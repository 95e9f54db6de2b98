"""Paged KV cache: the KV manager that owns it, page ids and their references, the radix prefix
cache, the window pages, the KV tensors."""

from .manager import KVManager, KVStats, SeqKV
from .pages import OutOfPages, PagePool
from .radix import PrefixMatch, RadixCache, RadixStats, Tier
from .storage import KVCache, KVLayerSpec, pages_for_budget

__all__ = ["KVCache", "KVLayerSpec", "KVManager", "KVStats", "OutOfPages", "PagePool", "PrefixMatch", "RadixCache",
           "RadixStats", "SeqKV", "Tier", "pages_for_budget"]

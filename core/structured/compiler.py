"""Grammars compiled off the engine loop: a thread pool, a time limit, a bounded LRU cache.

xgrammar compiles a grammar against the model's vocabulary (which tokens can follow which
state), milliseconds for a small schema and longer for large ones; its compile releases the GIL,
so the threads here never hold up the engine loop or the API process's event loop. ``request``
returns at once with a handle: the engine polls it between steps (a request waits in its own state
until its grammar is ready), the API process waits on it in a worker thread to refuse a grammar
that does not compile, or does not compile within ``timeout_s``, with a 400 naming the field.

A compile cannot be interrupted: one past its limit is refused but keeps its thread until it ends,
and its result is cached like any other (the pool is bounded, so such compiles delay the others
rather than multiply). The cache keeps compiled grammars (and compile errors, so a bad schema sent
again is refused at once) by least recent use, within ``cache_entries`` and ``cache_bytes``.

xgrammar (and transformers, which it imports) loads in the pool's first task, submitted with the
first request, so nothing that never asks for a grammar pays its import time (about 3 s); the load
does not count against a compile's limit.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from ..errors import InvalidRequest
from ..tokenizer import Tokenizer
from .params import StructuredOutputsParams

DEFAULT_CACHE_ENTRIES = 1024
# JSON is written on one line, as Python's json.dumps writes it ({"a": [1, 2], "b": "x"}), as with
# vLLM's disable_any_whitespace: where whitespace may run between any two tokens, a model can loop in
# it (tiny-qwen3-py fills every gap with tabs) and reach max_tokens before the JSON closes
JSON_ANY_WHITESPACE = False
LOAD_TIMEOUT_S = 300.0  # importing xgrammar and reading the vocabulary, once
MESSAGE_CHARS = 300  # of xgrammar's error message (it may quote the whole schema)
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[12:07:52] /project/cpp/x.cc:94: " before its messages


# xgrammar 0.2.9 writes a string with minLength/maxLength as characters of [^"\\\r\n], which admits the
# other control characters (a raw tab) that JSON forbids in strings (json.loads refuses them); its
# unbounded strings use the right class, and the bounded ones get it here
_BOUNDED_STRING_CHARS = r'[^\"\\\r\n]'
_JSON_STRING_CHARS = r'[^\0-\x1f\"\\]'


def json_strings_without_control_characters(ebnf: str) -> str:
    """xgrammar's grammar of a JSON schema, its bounded strings' characters those JSON allows."""
    return ebnf.replace(_BOUNDED_STRING_CHARS, _JSON_STRING_CHARS)


class _Entry:
    __slots__ = ("future", "submitted", "nbytes")

    def __init__(self, future: Future) -> None:
        self.future = future
        self.submitted = time.monotonic()
        self.nbytes = 0


class GrammarHandle:
    """One request's wait for its compiled grammar."""

    def __init__(self, compiler: "GrammarCompiler", entry: _Entry, params: StructuredOutputsParams) -> None:
        self._compiler = compiler
        self._entry = entry
        self._field = params.field

    def poll(self) -> Any | None:
        """The compiled grammar, None while it compiles; ``InvalidRequest`` if it failed or ran out of time."""
        if self._entry.future.done():
            return self._result()
        start = self._compiler.ready_at
        if start is not None and time.monotonic() > max(start, self._entry.submitted) + self._compiler.timeout_s:
            raise self._timed_out()
        return None

    def wait(self) -> Any:
        """Block (in a worker thread, never on a loop) until it compiled or failed."""
        self._compiler.wait_loaded(self._field)
        deadline = max(self._compiler.ready_at, self._entry.submitted) + self._compiler.timeout_s
        try:
            self._entry.future.result(timeout=max(deadline - time.monotonic(), 0.0))
        except FutureTimeout:
            raise self._timed_out() from None
        except Exception:
            pass
        return self._result()

    def settle(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for the compile to end (an idle engine, rather than spin)."""
        wait([self._entry.future], timeout)

    def _result(self) -> Any:
        exc = self._entry.future.exception()
        if exc is None:
            return self._entry.future.result()
        if isinstance(exc, InvalidRequest):
            raise InvalidRequest(self._field, exc.detail)
        lines = _XGRAMMAR_PREFIX.sub("", str(exc).strip()).splitlines() or [type(exc).__name__]
        raise InvalidRequest(self._field, f"does not compile to a grammar: {lines[0][:MESSAGE_CHARS]}")

    def _timed_out(self) -> InvalidRequest:
        return InvalidRequest(self._field, f"took longer than {self._compiler.timeout_s:g} s to compile to a grammar")


class GrammarCompiler:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, timeout_s: float, cache_bytes: int,
                 cache_entries: int = DEFAULT_CACHE_ENTRIES, workers: int = 2) -> None:
        """``vocab_size``: the model's (its logits' width), which may pass the tokenizer's;
        ``timeout_s`` and ``cache_bytes``: EngineConfig's grammar_compile_timeout and grammar_cache_memory."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.cache_entries = cache_entries
        self.cache_bytes = cache_bytes
        self.ready_at: float | None = None  # when xgrammar was loaded
        self._lock = threading.RLock()  # a compile that ends at once is accounted inside request()
        self._cache: OrderedDict[tuple, _Entry] = OrderedDict()
        self._bytes = 0
        self._xgr: Any = None
        self._compiler: Any = None
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="grammar")  # no thread until the first task
        self._loaded: Future | None = None  # xgrammar's load, submitted with the first request

    def _load(self) -> None:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.backend)
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                  stop_token_ids=sorted(self.tokenizer.eos_token_ids))
        self._xgr = xgr
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.ready_at = time.monotonic()

    def _start_loading(self) -> Future:
        with self._lock:
            if self._loaded is None:
                self._loaded = self._pool.submit(self._load)
            return self._loaded

    def wait_loaded(self, field: str) -> None:
        try:
            self._start_loading().result(timeout=LOAD_TIMEOUT_S)
        except Exception as exc:
            raise InvalidRequest(field, f"cannot be served: structured outputs are unavailable ({exc})") from None

    def request(self, params: StructuredOutputsParams) -> GrammarHandle:
        """A handle on the grammar ``params`` ask for: cached, compiling, or submitted now."""
        key = params.key()
        self._start_loading()
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
            else:
                entry = _Entry(self._pool.submit(self._compile, params))
                self._cache[key] = entry
                entry.future.add_done_callback(lambda f, k=key, e=entry: self._account(k, e))
                self._evict()
        return GrammarHandle(self, entry, params)

    def matcher(self, compiled: Any) -> Any:
        """A fresh matcher (one per sequence) walking ``compiled`` from its start."""
        return self._xgr.GrammarMatcher(compiled)

    @property
    def cache_size(self) -> tuple[int, int]:
        """(entries, bytes of compiled grammars) held now."""
        with self._lock:
            return len(self._cache), self._bytes

    def _compile(self, params: StructuredOutputsParams) -> Any:
        self._start_loading().result()
        c, kind, value = self._compiler, params.kind, params.value
        if kind in ("json", "json_object"):
            schema, strict = (value, True) if kind == "json" else ('{"type": "object"}', False)
            grammar = self._xgr.Grammar.from_json_schema(schema, any_whitespace=JSON_ANY_WHITESPACE, strict_mode=strict)
            return c.compile_grammar(json_strings_without_control_characters(str(grammar)))
        if kind == "structural_tag":
            grammar = self._xgr.Grammar.from_structural_tag(value)
            return c.compile_grammar(json_strings_without_control_characters(str(grammar)))
        if kind == "regex":
            return c.compile_regex(value)
        if kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in value))
        return c.compile_grammar(value)

    def _account(self, key: tuple, entry: _Entry) -> None:
        """A compile ended: count its bytes while it is cached, and keep the cache within its bounds."""
        f = entry.future
        nbytes = f.result().memory_size_bytes if f.exception() is None else 0
        with self._lock:
            if self._cache.get(key) is entry:
                entry.nbytes = nbytes
                self._bytes += nbytes
                self._evict()

    def _evict(self) -> None:
        """Drop the least recently used entries past the bounds (the newest always stays); the lock is held."""
        while len(self._cache) > 1 and (len(self._cache) > self.cache_entries or self._bytes > self.cache_bytes):
            _, old = self._cache.popitem(last=False)
            self._bytes -= old.nbytes

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

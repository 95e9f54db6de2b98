"""Memory sizes: one parser for the Python API and the command line."""

from __future__ import annotations

import argparse
import random

import pytest

from engine.core.config import EngineConfig
from engine.core.sizes import parse_size
from engine.server.cli import build_parser


def test_the_forms_people_write():
    n = random.randrange(1, 1000)
    assert parse_size(f"{n}GiB") == parse_size(f"{n} gib") == n * 2**30
    assert parse_size(f"{n}MB") == parse_size(f"{n}m") == n * 10**6
    assert parse_size(f"{n}.5KiB") == int((n + 0.5) * 2**10)
    assert parse_size(str(n)) == parse_size(n) == n
    for bad in ("lots", "1XB", "", "-1GiB", True):
        with pytest.raises(ValueError, match="not a memory size"):
            parse_size(bad)


def test_the_python_api_takes_what_the_command_line_takes():
    n = random.randrange(1, 64)
    config = EngineConfig(model="m", kv_cache_memory=f"{n}GiB", graph_memory="512MiB", grammar_cache_memory="1MB")
    assert (config.kv_cache_memory, config.graph_memory, config.grammar_cache_memory) == (n * 2**30, 2**29, 10**6)
    args = build_parser().parse_args(["generate", "--prompt", "x", "--kv-cache-memory", f"{n}GiB"])
    assert args.kv_cache_memory == config.kv_cache_memory
    with pytest.raises(ValueError, match="kv_cache_memory: not a memory size: 'lots'"):
        EngineConfig(model="m", kv_cache_memory="lots")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "x", "--kv-cache-memory", "lots"])


def test_the_flag_defaults_are_the_configs():
    args = build_parser().parse_args(["serve"])
    assert args.grammar_cache_memory == EngineConfig(model="m").grammar_cache_memory
    assert isinstance(args.max_request_body, int)

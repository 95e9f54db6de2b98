"""Live servers shared by the server tests: tiny-qwen3-py and the embedded default model."""

from __future__ import annotations

import pytest

from live_server import LiveServer

LIMIT_ARGS = ("--max-n", "4", "--max-logprobs", "5", "--max-stop-sequences", "4", "--max-seqs-per-request", "16",
              "--max-logprob-entries", "20000")


@pytest.fixture(scope="session")
def tiny_server(tiny_qwen3, tmp_path_factory):
    # a short grammar time limit, so a test can send a grammar that takes longer (test_structured_outputs.py);
    # no chat template, so the tool-call format is named (test_tool_calls.py)
    server = LiveServer(str(tiny_qwen3), *LIMIT_ARGS, "--max-model-len", "512", "--grammar-compile-timeout", "1",
                        "--tool-call-parser", "hermes",
                        log=tmp_path_factory.mktemp("logs") / "tiny-server.log").wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def default_server(tmp_path_factory):
    cache = tmp_path_factory.mktemp("engine-cache")
    server = LiveServer(None, *LIMIT_ARGS, env={"ENGINE_CACHE_DIR": str(cache)},
                        log=tmp_path_factory.mktemp("logs") / "default-server.log").wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="session", params=["tiny", "default"])
def server(request):
    """Each test using it runs against both served models."""
    return request.getfixturevalue(f"{request.param}_server")


HICACHE_ARGS = ("--page-size", "4", "--num-pages", "40", "--max-model-len", "512", "--enable-hierarchical-cache",
                "--hicache-ratio", "1", "--hicache-storage-prefetch-threshold", "8",
                "--hicache-storage-prefetch-policy", "wait_complete")


@pytest.fixture(scope="session")
def hicache_server(tiny_qwen3, tmp_path_factory):
    """tiny-qwen3-py on a device cache of 40 pages of 4 tokens, host memory for as many, and a file
    tier (its directory is ``server.storage_dir``)."""
    storage = tmp_path_factory.mktemp("hicache-storage")
    server = LiveServer(str(tiny_qwen3), *HICACHE_ARGS, "--hicache-storage-backend", "file",
                        "--hicache-storage-dir", str(storage),
                        log=tmp_path_factory.mktemp("logs") / "hicache-server.log").wait_ready()
    server.storage_dir = storage
    yield server
    server.stop()

"""Live servers shared by the server tests: tiny-qwen3-py and the embedded default model."""

from __future__ import annotations

import pytest

from live_server import LiveServer

LIMIT_ARGS = ("--max-n", "4", "--max-logprobs", "5", "--max-stop-sequences", "4", "--max-seqs-per-request", "16",
              "--max-logprob-entries", "20000")


@pytest.fixture(scope="session")
def tiny_server(tiny_qwen3, tmp_path_factory):
    # a short grammar time limit, so a test can send a grammar that takes longer (test_structured_outputs.py)
    server = LiveServer(str(tiny_qwen3), *LIMIT_ARGS, "--max-model-len", "512", "--grammar-compile-timeout", "1",
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

"""The storage tier attached and detached at run time through PUT/DELETE/GET /hicache/storage-backend:
under load (requests in flight go on, greedy outputs unchanged), writes going to the directory
attached now and to none while detached, bad fields refused naming them, the API key required."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import HICACHE_ARGS
from live_server import LiveServer

PATH = "/hicache/storage-backend"


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    """A hierarchical cache with no storage tier at start-up."""
    s = LiveServer(str(tiny_qwen3), *HICACHE_ARGS,
                   log=tmp_path_factory.mktemp("logs") / "hicache-admin.log").wait_ready()
    yield s
    s.stop()


def admin(server, method: str, body: dict | None = None, key: bool = True) -> httpx.Response:
    return httpx.request(method, server.url + PATH, json=body, headers=server.headers if key else {}, timeout=60)


def generate(server, ids: list[int]) -> list[int]:
    r = httpx.post(server.url + "/generate", headers=server.headers, timeout=300,
                   json={"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def records(directory) -> int:
    return len(list(directory.rglob("*.kv")))


def settled(directories) -> list[int]:
    """The records in each directory once no more arrive for half a second (at most 10 s)."""
    deadline, counts = time.monotonic() + 10, None
    while time.monotonic() < deadline:
        now = [records(d) for d in directories]
        if now == counts and any(now):
            break
        counts = now
        time.sleep(0.5)
    return counts


def test_attach_and_detach_under_load_leave_outputs_unchanged(server, tmp_path, seed):
    rng = random.Random(seed)
    assert admin(server, "GET").json() == {"hicache_storage_backend": None}
    prompts = [[rng.randrange(4096) for _ in range(rng.randint(10, 40))] for _ in range(12)]
    alone = [generate(server, p) for p in prompts]
    dirs = [tmp_path / "a", tmp_path / "b"]

    stop, answers = threading.Event(), []

    def toggle():
        i = 0
        while not stop.is_set():
            answers.append(admin(server, "PUT", {"hicache_storage_backend": "file",
                                                 "hicache_storage_dir": str(dirs[i % 2]),
                                                 "hicache_storage_prefetch_threshold": 8}))
            answers.append(admin(server, "DELETE"))
            i += 1

    toggler = threading.Thread(target=toggle)
    toggler.start()
    try:
        with ThreadPoolExecutor(6) as pool:  # fresh prompts in flight beside the same ones again
            fresh = [[rng.randrange(4096) for _ in range(rng.randint(10, 40))] for _ in range(12)]
            loaded = list(pool.map(lambda p: generate(server, p), prompts + fresh))
    finally:
        stop.set()
        toggler.join()
    assert loaded[:len(prompts)] == alone
    assert len(answers) >= 2 and all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200]
    assert {a.json()["hicache_storage_backend"] for a in answers} == {"file", None}

    # attached, a new prompt's records reach the directory; detached, nothing is written anywhere
    target = tmp_path / "c"
    assert admin(server, "PUT", {"hicache_storage_backend": "file", "hicache_storage_dir": str(target)}).json() == \
        {"hicache_storage_backend": "file"}
    assert admin(server, "GET").json() == {"hicache_storage_backend": "file"}
    generate(server, [rng.randrange(4096) for _ in range(30)])
    assert settled([target])[0] > 0  # written by the storage tier's writer thread, soon after
    assert admin(server, "DELETE").json() == {"hicache_storage_backend": None}
    before = settled([*dirs, target])  # a write under way at the detach ends alone
    generate(server, [rng.randrange(4096) for _ in range(30)])
    assert [records(d) for d in (*dirs, target)] == before


def test_bad_fields_are_refused_by_name_and_the_key_is_required(server, tmp_path, seed):
    rng = random.Random(seed)
    good = tmp_path / "good"
    assert admin(server, "PUT", {"hicache_storage_backend": "file", "hicache_storage_dir": str(good)}).status_code == 200
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    for body, field in [({"hicache_storage_backend": "nosuch"}, "hicache_storage_backend"),
                        ({"hicache_storage_backend": "host"}, "hicache_storage_backend"),
                        ({"hicache_storage_backend": ""}, "hicache_storage_backend"),
                        ({}, "hicache_storage_backend"),
                        ({"hicache_storage_backend": 3}, "hicache_storage_backend"),
                        ({"hicache_storage_backend": "file", "hicache_storage_dir": str(a_file / "x")}, "hicache_storage_dir"),
                        ({"hicache_storage_backend": "file"}, "hicache_storage_dir"),  # none given, none at start-up
                        ({"hicache_storage_backend": "file", "hicache_storage_prefetch_policy": "eager"},
                         "hicache_storage_prefetch_policy"),
                        ({"hicache_storage_backend": "file", "hicache_storage_prefetch_threshold": 0},
                         "hicache_storage_prefetch_threshold"),
                        ({"hicache_storage_backend": "file", "hicache_storage_max_size": -1}, "hicache_storage_max_size"),
                        ({"hicache_storage_backend": "file", "hicache_write_policy": "write_back"}, "hicache_write_policy")]:
        r = admin(server, "PUT", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (body, r.text)
        assert admin(server, "GET").json() == {"hicache_storage_backend": "file"}  # the tier attached before stays
    for method in ("GET", "PUT", "DELETE"):
        r = admin(server, method, {"hicache_storage_backend": "file"}, key=False)
        assert r.status_code == 401, (method, r.text)
    assert admin(server, "GET").json() == {"hicache_storage_backend": "file"}
    generate(server, [rng.randrange(4096) for _ in range(20)])  # still serving
    assert admin(server, "DELETE").status_code == 200


def test_a_tier_attached_with_a_size_bound_keeps_its_directory_within_it(server, tmp_path, seed):
    rng = random.Random(seed)
    bound = 2**17  # bytes: a few pages' records of tiny-qwen3-py
    assert admin(server, "PUT", {"hicache_storage_backend": "file", "hicache_storage_dir": str(tmp_path),
                                 "hicache_storage_max_size": bound / 2**30}).status_code == 200
    for _ in range(4):
        generate(server, [rng.randrange(4096) for _ in range(40)])
    settled([tmp_path])
    assert 0 < sum(p.stat().st_size for p in tmp_path.rglob("*.kv")) <= bound
    assert admin(server, "DELETE").status_code == 200


def test_a_server_without_the_hierarchy_refuses_to_attach(tiny_server, tmp_path):
    r = admin(tiny_server, "PUT", {"hicache_storage_backend": "file", "hicache_storage_dir": str(tmp_path)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "hicache_storage_backend"
    assert admin(tiny_server, "GET").json() == {"hicache_storage_backend": None}
    assert admin(tiny_server, "DELETE").json() == {"hicache_storage_backend": None}

"""The NIXL storage tier over NIXL's object plugin (OBJ) and a local S3 server (moto), where the
optional nixl and moto packages are installed (skipped otherwise, as in CI): records round-trip as
objects, found by a HEAD, a missing one a plain miss and a bad one a miss until rewritten; a config
the OBJ plugin cannot serve is refused naming the setting, a bucket it cannot write refused at
start-up; an engine hits what another engine stored in the bucket and decodes as an engine without
tiers does, no page left behind; a long run's existence check, reads and writes go out a request a
lane, side by side, a record gone mid-run or a PUT refused failing only itself; a bucket refusing
every write is detached."""

from __future__ import annotations

import importlib
import importlib.util
import random
import uuid

import pytest
import torch

if importlib.util.find_spec("nixl") is None:
    pytest.skip("nixl is not installed (pip install 'engine[nixl]')", allow_module_level=True)
pytest.importorskip("moto.server", reason="moto is not installed (pip install 'moto[server]')")
boto3 = pytest.importorskip("boto3", reason="boto3 (moto's) is not installed")

from s3_loopback import LoopbackS3, import_nixl  # noqa: E402

import_nixl()

from engine import LLM, SamplingParams  # noqa: E402
from engine.core.config import EngineConfig  # noqa: E402
from engine.core.families.cache_tier import TierContext, TierLayout, TierPage, prefix_keys  # noqa: E402
from engine.core.registry import SelectionError  # noqa: E402
from engine.core.tiers.file import record_name  # noqa: E402
from engine.core.tiers.record import encode  # noqa: E402
from engine.plugins import nixl_obj  # noqa: E402
from engine.plugins.nixl_store import NixlStore  # noqa: E402
from test_storage_plugins import plugins, second_engine_hits_the_first  # noqa: E402

LAYOUT = TierLayout({"page": (96, 32), "window": (40,)}, "test-model")  # a short read of the window kind too
ENVIRONMENT = ("NIXL_STORAGE_PLUGIN", "AWS_ENDPOINT_URL", "AWS_DEFAULT_BUCKET", "AWS_REGION", "AWS_ACCESS_KEY_ID",
               "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


@pytest.fixture(autouse=True)
def no_environment(monkeypatch):
    for name in ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def s3_server():
    server = LoopbackS3()
    try:
        NixlStore(("OBJ",), {"endpoint_override": server.url, "scheme": "http", "bucket": "none"})
    except RuntimeError as exc:
        server.stop()
        pytest.skip(f"NIXL's OBJ plugin does not start here: {exc}")
    yield server
    server.stop()


@pytest.fixture
def endpoint(s3_server):
    return s3_server.url


def client(endpoint):
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="test",
                        aws_secret_access_key="test")


@pytest.fixture
def bucket(endpoint):
    name = f"kv-{uuid.uuid4().hex[:12]}"
    client(endpoint).create_bucket(Bucket=name)
    return name


def options(endpoint, bucket, **more) -> dict:
    return {"nixl": {"plugin": "OBJ", "endpoint_override": endpoint, "bucket": bucket, "access_key": "test",
                     "secret_key": "test", **more}}


def context(plugin_options, **config) -> TierContext:
    return TierContext(None, None, EngineConfig(model="-", enable_hierarchical_cache=True, hicache_storage_backend="nixl",
                                                plugin_options=plugin_options, **config), LAYOUT)


def records(n: int, seed: int) -> list[TierPage]:
    g = torch.Generator().manual_seed(seed)
    keys = prefix_keys(list(range(n * 4)), 4, LAYOUT.model)
    return [TierPage.of(k, torch.randint(0, 256, (40,) if i % 2 else (128,), dtype=torch.uint8, generator=g),
                        "window" if i % 2 else "page") for i, k in enumerate(keys)]


def test_records_round_trip_as_objects_and_a_missing_or_bad_one_is_a_miss(endpoint, bucket, seed):
    ctx = context(options(endpoint, bucket))
    tier = plugins().select("cache_tier", ctx, "nixl").create(ctx)
    assert tier.plugin == "OBJ"
    recs, s3 = records(5, seed), client(endpoint)
    keys = [r.key for r in recs]
    assert tier.put(recs[:3]) == [True] * 3
    assert s3.head_object(Bucket=bucket, Key=record_name(keys[1]))["ContentLength"] == sum(
        memoryview(p).nbytes for p in encode(recs[1]))  # an object named as the file tier names its file
    assert tier.contains(keys) == 3 and tier.contains(keys[3:]) == 0
    other = plugins().select("cache_tier", ctx, "nixl").create(ctx)  # another engine on the same bucket
    for reader in (tier, other):
        got = reader.get(keys)
        assert got[3:] == [None, None]
        assert all(g.intact() and torch.equal(g.data, r.data) and g.kind == r.kind for g, r in zip(got[:3], recs))
    assert other.contains(keys) == 3 and tier.read_failures == other.read_failures == 0  # absence is no failure

    s3.put_object(Bucket=bucket, Key=record_name(keys[0]), Body=b"".join(encode(recs[2])))  # another key's record
    assert tier.get(keys[:1]) == [None] and tier.rejected == 1 and tier.contains(keys) == 0
    assert tier.put(recs[:1]) == [True] and tier.get(keys[:1])[0].intact() and tier.contains(keys) == 3  # rewritten
    raw = b"".join(encode(recs[2]))
    s3.put_object(Bucket=bucket, Key=record_name(keys[2]), Body=raw[:len(raw) - random.Random(seed).randint(1, 30)])
    assert not other.get(keys[2:3])[0].intact()  # cut short: it fails its checksum
    other.reject(keys[2])  # what the hierarchy does with it
    assert other.contains(keys) == 2 and other.put(recs[2:3]) == [True] and other.get(keys[2:3])[0].intact()


@pytest.mark.parametrize("settings, config, reason", [
    ({"plugin": "OBJ", "bucket": "b"}, {}, r"no S3 endpoint: .*endpoint_override.* or AWS_ENDPOINT_URL"),
    ({"plugin": "OBJ", "endpoint_override": "http://h:1"}, {}, r"no S3 bucket: .*\"bucket\".* or AWS_DEFAULT_BUCKET"),
    ({"plugin": "S3"}, {}, r"NIXL_STORAGE_PLUGIN is 'S3': \"OBJ\""),
    ({"plugin": "OBJ", "endpoint_override": "ftp://h:1", "bucket": "b"}, {}, r"scheme 'ftp'"),
    ({"plugin": "OBJ", "endpoint_override": "http://h:1", "bucket": "b", "buckets": "c"}, {},
     r"no option 'buckets'"),
    ({"plugin": "OBJ", "endpoint_override": "http://h:1", "bucket": "b"}, {"hicache_storage_dir": "/tmp"},
     r"--hicache-storage-dir .* for a directory"),
    ({"bucket": "b"}, {"hicache_storage_dir": "/tmp"}, r'sets bucket without "plugin": "OBJ"'),
])
def test_a_config_the_object_plugin_cannot_serve_is_refused_naming_the_setting(settings, config, reason):
    with pytest.raises(SelectionError, match=reason):
        plugins().select("cache_tier", context({"nixl": settings}, **config), "nixl")


def test_the_environment_configures_it_and_a_bucket_it_cannot_write_refuses_it(endpoint, bucket, monkeypatch):
    for name, value in (("NIXL_STORAGE_PLUGIN", "OBJ"), ("AWS_ENDPOINT_URL", endpoint), ("AWS_DEFAULT_BUCKET", bucket),
                        ("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test")):
        monkeypatch.setenv(name, value)
    ctx = context({})
    tier = plugins().select("cache_tier", ctx, "nixl").create(ctx)
    assert tier.plugin == "OBJ" and tier.store.agent.query_memory([(0, 0, 0, nixl_obj.PROBE)], "OBJ", "OBJ") == [{}]
    ctx = context({"nixl": {"bucket": "no-such-bucket"}})  # the option wins over the environment
    with pytest.raises(RuntimeError, match=f"cannot write to bucket 'no-such-bucket' at {endpoint}"):
        plugins().select("cache_tier", ctx, "nixl").create(ctx)
    import nixl

    monkeypatch.setattr(nixl._api.nixl_agent, "get_plugin_list", lambda self: ["POSIX"])  # a nixl built without it
    with pytest.raises(RuntimeError, match=r"starts none of OBJ; it lists \['POSIX'\]"):
        plugins().select("cache_tier", context({}), "nixl").create(context({}))


def test_an_engine_hits_what_another_stored_in_the_bucket(tiny_qwen3, endpoint, bucket, seed):
    def stored(written: int) -> None:  # every record an object, and the probe
        assert client(endpoint).list_objects_v2(Bucket=bucket)["KeyCount"] == written + 1

    second_engine_hits_the_first(tiny_qwen3, seed, "nixl", stored, plugin_options=options(endpoint, bucket))


def test_many_records_are_asked_for_together_and_a_gone_one_fails_only_itself(s3_server, bucket, seed):
    """An existence check and a get of a long run each go out as one request a lane, the lanes' at
    once (the server answers several at a time), a HEAD and a GET a record; a record deleted after
    the check is a plain miss in the middle of the get (its lane's run read again one by one), the
    others read intact."""
    rng = random.Random(seed)
    ctx = context(options(s3_server.url, bucket))
    tier = plugins().select("cache_tier", ctx, "nixl").create(ctx)
    recs = [r for r in records(rng.randint(3 * nixl_obj.LANES, 4 * nixl_obj.LANES), seed) if r.kind == "page"]
    keys = [r.key for r in recs]
    assert tier.put(recs) == [True] * len(recs)
    s3_server.reset()
    assert tier.contains(keys) == len(recs)
    assert s3_server.requests == {"HEAD": len(recs)} and s3_server.most_at_once > 1
    gone = rng.randrange(1, len(recs) - 1)
    client(s3_server.url).delete_object(Bucket=bucket, Key=record_name(keys[gone]))
    posted = []
    for lane in tier.lanes:
        lane.post = lambda *args, post=lane.post: posted.append(args[3]) or post(*args)
    s3_server.reset()
    got = tier.get(keys)
    runs, alone = posted[:nixl_obj.LANES], posted[nixl_obj.LANES:]
    assert [r[3] for run in runs for r in run] == [record_name(k) for k in keys]  # a run a lane, in order
    failed = next(run for run in runs if (record_name(keys[gone]), None) in {(r[3], r[2]) for r in run})
    assert [run[0][3] for run in alone] == [r[3] for r in failed]  # the failed run's records again, one by one
    assert s3_server.most_at_once > 1 and s3_server.requests == {"GET": len(recs) + len(failed), "HEAD": 1}
    assert got[gone] is None and tier.read_failures == tier.rejected == 0
    assert all(g.intact() and torch.equal(g.data, r.data) for i, (g, r) in enumerate(zip(got, recs)) if i != gone)


@pytest.fixture
def refusing(s3_server):
    """The server, its PUTs refused where ``refuse`` says, all taken again after the test."""
    yield s3_server
    s3_server.refuse = lambda path: False


def test_a_run_of_records_is_written_a_request_a_lane_and_a_refused_put_fails_only_itself(refusing, bucket, seed):
    """A put of a long run goes out as one write request a lane (a PUT a record), the lanes' at once;
    a PUT the bucket refuses fails its lane's request, whose records are then written one by one:
    only the refused one is refused (counted, the reason named), every other record is an object
    of its own that reads back intact."""
    rng = random.Random(seed)
    ctx = context(options(refusing.url, bucket))
    tier = plugins().select("cache_tier", ctx, "nixl").create(ctx)
    recs = records(rng.randint(3 * nixl_obj.LANES, 4 * nixl_obj.LANES), seed)
    keys = [r.key for r in recs]
    bad = rng.randrange(len(recs))
    refusing.refuse = lambda path: path.endswith(record_name(keys[bad]))
    posted = []
    for lane in tier.lanes:
        lane.post = lambda *args, post=lane.post: posted.append(args[3]) or post(*args)
    refusing.reset()
    done = tier.put(recs)
    assert done == [i != bad for i in range(len(recs))]
    assert tier.failed_writes == 1 and record_name(keys[bad]) in tier.last_error
    runs, alone = posted[:nixl_obj.LANES], posted[nixl_obj.LANES:]
    assert [r[3] for run in runs for r in run] == [record_name(k) for k in keys]  # a run a lane, in order
    failed = next(run for run in runs if record_name(keys[bad]) in {r[3] for r in run})
    assert [run[0][3] for run in alone] == [r[3] for r in failed]  # the refused run's records again, one by one
    assert refusing.requests == {"HEAD": len(recs), "PUT": len(recs) + len(failed)} and refusing.most_at_once > 1
    listed = client(refusing.url).list_objects_v2(Bucket=bucket)["Contents"]
    assert sorted(o["Key"] for o in listed) == sorted([nixl_obj.PROBE] + [record_name(k) for i, k in enumerate(keys)
                                                                          if i != bad])
    other = plugins().select("cache_tier", ctx, "nixl").create(ctx)  # another engine reads them
    got = other.get(keys)
    assert got[bad] is None and other.read_failures == other.rejected == 0
    assert all(g.intact() and torch.equal(g.data, r.data) and g.kind == r.kind
               for i, (g, r) in enumerate(zip(got, recs)) if i != bad)
    refusing.refuse = lambda path: False
    assert tier.put(recs) == [True] * len(recs) and other.contains(keys) == len(recs)  # written once taken again


def test_a_bucket_refusing_every_write_is_detached_and_serving_goes_on(tiny_qwen3, refusing, bucket, seed):
    """Every record's PUT refused (a quota filled after start-up wrote its probe): the engine's
    writes are refused, counted, the tier detached as a full directory is, and the engine goes on
    serving from host memory."""
    refusing.refuse = lambda path: path.endswith(".kv")
    rng = random.Random(seed)
    prompt = [rng.randrange(4096) for _ in range(40)]
    llm = LLM(str(tiny_qwen3), dtype="float32", progress=False, page_size=4, num_pages=40,
              enable_hierarchical_cache=True, hicache_storage_backend="nixl",
              plugin_options=options(refusing.url, bucket))
    try:
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        first = llm.generate([prompt], params)[0]
        lower = llm.engine.kv_manager.lower
        lower.flush_storage(30)
        assert lower.reader is None and lower.stats.storage_written == 0 and lower.stats.storage_refused >= 10
        assert llm.engine.stats().hicache.storage_backend is None
        again = llm.generate([prompt], params)[0]
        assert again.outputs[0].token_ids == first.outputs[0].token_ids and again.num_cached_tokens >= 36
    finally:
        llm.engine.shutdown()


def test_a_put_longer_than_a_run_is_written_in_runs_of_that_bound(s3_server, bucket, seed, monkeypatch):
    """A put gathers at most WRITE_RUN_BYTES of records at once (the copy it sends from), as many as
    fit, in order; every record of every run reads back intact."""
    rng = random.Random(seed)
    monkeypatch.setattr(nixl_obj, "WRITE_RUN_BYTES", rng.randint(128, 400))
    ctx = context(options(s3_server.url, bucket))
    tier = plugins().select("cache_tier", ctx, "nixl").create(ctx)
    recs = records(rng.randint(12, 20), seed)
    runs = []
    tier._write_run = lambda pages, write=tier._write_run: runs.append(pages) or write(pages)
    assert tier.put(recs) == [True] * len(recs)
    assert [p.key for run in runs for p in run] == [r.key for r in recs] and len(runs) > 1
    sizes = [sum(p.data.nbytes for p in run) for run in runs]
    assert all(s <= nixl_obj.WRITE_RUN_BYTES for s in sizes)
    assert all(s + nxt[0].data.nbytes > nixl_obj.WRITE_RUN_BYTES for s, nxt in zip(sizes, runs[1:]))  # as many as fit
    got = tier.get([r.key for r in recs])
    assert all(g.intact() and torch.equal(g.data, r.data) for g, r in zip(got, recs))

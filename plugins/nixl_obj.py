"""NIXL's object plugin (OBJ) as the nixl storage tier's store: each record (core/tiers/record.py)
an object in an S3 bucket, named as the file tier names its file (``ab/<key>.kv``).

Asked for with ``plugin_options["nixl"]["plugin"]`` or NIXL_STORAGE_PLUGIN ``OBJ`` (unset: NIXL's
file plugins, nixl.py). The bucket's settings take NIXL's own parameter names, from
``plugin_options["nixl"]``, else the environment the AWS tools read, else the default:
``endpoint_override`` (AWS_ENDPOINT_URL, "http://HOST:PORT"; required), ``bucket``
(AWS_DEFAULT_BUCKET; required), ``region`` (AWS_REGION, "us-east-1"), ``scheme`` (the endpoint's,
http or https), ``access_key``, ``secret_key``, ``session_token`` (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN; unset: the AWS SDK's own credential chain).

Start-up writes a probe object, so an unreachable endpoint or a missing bucket refuses the tier
with the reason. An S3 PUT replaces an object whole: a reader sees a complete record or none, as
the file tier's rename gives. Existence is a HEAD (NIXL's query). Many records are asked for
together, split over ``LANES`` NIXL agents side by side: a ``get`` as one transfer request a lane
(a descriptor, a GET, a record), a ``put`` likewise (a PUT a record), an existence check as one
query a lane; a long run's requests go ``LANES`` at a time or more, not one after another. A read
asks for the largest record's length and room for its header (S3 answers with what the object
holds) and the record's header says where it ends. NIXL deletes no object: a bad record (``reject``) stays a miss for
this engine until its next write of that prefix replaces it. The bucket's own lifecycle rules
bound its size.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor

from ..core.families.cache_tier import CacheTier, TierPage
from ..core.tiers.file import record_name
from ..core.tiers.record import decode, encode
from .nixl_store import NixlStore, gather

logger = logging.getLogger(__name__)

SETTINGS = {  # option of plugin_options["nixl"]: (environment variable, default)
    "plugin": ("NIXL_STORAGE_PLUGIN", None),
    "endpoint_override": ("AWS_ENDPOINT_URL", None),
    "bucket": ("AWS_DEFAULT_BUCKET", None),
    "region": ("AWS_REGION", "us-east-1"),
    "scheme": (None, None),  # the endpoint's
    "access_key": ("AWS_ACCESS_KEY_ID", None),
    "secret_key": ("AWS_SECRET_ACCESS_KEY", None),
    "session_token": ("AWS_SESSION_TOKEN", None),
}
LANES = 8  # NIXL agents a run of records is split over: one agent's OBJ plugin sends its GETs from a pool
# sized by the CPU count (one at a time on a 2-CPU host) and its HEADs one after another
WRITE_RUN_BYTES = 64 << 20  # records a put gathers and sends at once (their copy in host memory), as a
# prefetch reads (core/kv/prefetch.py's READ_BATCH_BYTES)
HEADER_ROOM = 1024  # bytes read past the largest record for its header (record.py: about 150)
PROBE = "engine-kv-probe"  # the object start-up writes


def nixl_options(ctx) -> dict:
    return (getattr(ctx.engine_config, "plugin_options", None) or {}).get("nixl", {})


def object_settings(ctx) -> dict:
    options = nixl_options(ctx)
    s = {k: options.get(k, os.environ.get(env, default) if env else default) for k, (env, default) in SETTINGS.items()}
    endpoint = s["endpoint_override"] or ""
    s["scheme"] = s["scheme"] or (endpoint.split("://")[0] if "://" in endpoint else "https")
    return s


def object_reasons(ctx) -> list[str]:
    """Why the OBJ plugin cannot serve this config (empty: it may; start-up tries the bucket)."""
    s, options, config = object_settings(ctx), nixl_options(ctx), ctx.engine_config
    reasons = [f'plugin_options["nixl"] has no option {k!r} (options: {", ".join(SETTINGS)})'
               for k in options if k not in SETTINGS]
    if s["plugin"] != "OBJ":
        return reasons + [f'plugin_options {{"nixl": {{"plugin": ...}}}} or NIXL_STORAGE_PLUGIN is {s["plugin"]!r}: '
                          '"OBJ" (an S3 bucket), or unset (NIXL\'s file plugins)']
    if not s["endpoint_override"]:
        reasons.append('no S3 endpoint: plugin_options {"nixl": {"endpoint_override": "http://HOST:PORT"}} '
                       "or AWS_ENDPOINT_URL")
    if not s["bucket"]:
        reasons.append('no S3 bucket: plugin_options {"nixl": {"bucket": NAME}} or AWS_DEFAULT_BUCKET')
    if s["scheme"] not in ("http", "https"):
        reasons.append(f'scheme {s["scheme"]!r} (plugin_options["nixl"]["scheme"] or the endpoint\'s) '
                       "is neither http nor https")
    if getattr(config, "hicache_storage_dir", None) or getattr(config, "hicache_storage_max_size", 0):
        reasons.append("--hicache-storage-dir and --hicache-storage-max-size are for a directory; the OBJ plugin "
                       "keeps records in the bucket (bounded by its lifecycle rules)")
    return reasons


class NixlObjectTier(CacheTier):
    name = "nixl"

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        s = object_settings(ctx)
        self.where = f"bucket {s['bucket']!r} at {s['endpoint_override']}"
        params = {k: str(v) for k, v in s.items() if k != "plugin" and v is not None}
        self.lanes = [NixlStore(("OBJ",), params) for _ in range(LANES)]
        self.store, self.plugin = self.lanes[0], self.lanes[0].plugin
        self._asking = ThreadPoolExecutor(LANES, thread_name_prefix="hicache-s3-query")  # the lanes' HEADs
        try:
            self.store.write([PROBE.encode()], "OBJ", meta=PROBE)
        except OSError as exc:
            raise RuntimeError(f"NIXL's OBJ plugin cannot write to {self.where} ({exc})") from None
        self.read_size = max(map(ctx.layout.record_bytes, ctx.layout.segments)) + HEADER_ROOM
        self._bad: set[str] = set()  # records read bad here: a miss until this engine writes them again
        self.failed_writes = 0  # records the bucket refused (their PUT failed alone too)
        logger.info("hierarchical cache: NIXL OBJ stores records in %s", self.where)

    def put(self, pages: list[TierPage]) -> list[bool]:
        """The records the bucket lacks (a HEAD each, as ``contains``; else another engine wrote
        them) written in runs of up to ``WRITE_RUN_BYTES`` (``_write_run``); False for those the
        bucket refused (counted in ``failed_writes``, ``last_error`` saying why)."""
        held = self._held([p.key for p in pages]) or [False] * len(pages)
        wanted = [p for p, there in zip(pages, held) if not there]
        runs, size = [[]], 0
        for page in wanted:
            if runs[-1] and size + page.data.nbytes > WRITE_RUN_BYTES:
                runs.append([])
                size = 0
            runs[-1].append(page)
            size += page.data.nbytes
        refused = {name for run in runs if run for name in self._write_run(run)}
        self._bad.difference_update(p.key for p in wanted if record_name(p.key) not in refused)
        return [record_name(p.key) not in refused for p in pages]

    def _write_run(self, pages: list[TierPage]) -> list[str]:
        """``pages`` gathered into one buffer (their one copy) and written in one transfer request a
        lane (a descriptor, a PUT, a record), the lanes' requests posted together: a run costs about
        one round trip, not one a record. Where a lane's request fails, its records are written one
        by one, so only those that fail are refused; the objects refused."""
        buffer, spans = gather([encode(p) for p in pages])
        regions = [(at, size, None, record_name(p.key)) for p, (at, size) in zip(pages, spans)]
        chunks = _split(regions)
        posted = [lane.post("WRITE", buffer, "OBJ", chunk) for lane, chunk in zip(self.lanes, chunks)]
        refused = []
        for request, chunk in zip(posted, chunks):
            try:
                request.wait()
            except OSError:
                refused += self._write_alone(buffer, chunk)
        return refused

    def _write_alone(self, buffer, regions: list) -> list[str]:
        """Write each of ``regions`` (of ``buffer``) in a request of its own; the objects refused."""
        refused = []
        for region in regions:
            try:
                self.store.transfer("WRITE", buffer, "OBJ", [region])
            except OSError as exc:
                self.failed_writes += 1
                self.last_error = f"writing {region[3]} to {self.where}: {exc}"
                refused.append(region[3])
        return refused

    def get(self, keys: list[str]) -> list[TierPage | None]:
        """The records in one transfer request a lane (a descriptor a record, the lanes' requests
        posted together): a run of records costs about one round trip. Where a lane's request
        fails (an object gone meanwhile, a bucket not answering), its records are read one by one,
        so only those that fail are misses."""
        import torch

        wanted = [k for k in keys if k not in self._bad]
        if len(wanted) < 2:
            return [self._get(k) for k in keys]
        size = self.read_size
        buffer = torch.empty(len(wanted) * size, dtype=torch.uint8)
        chunks = _split(list(range(len(wanted))))
        posted = [lane.post("READ", buffer, "OBJ", [(i * size, size, None, record_name(wanted[i])) for i in chunk])
                  for lane, chunk in zip(self.lanes, chunks)]
        failed = set()
        for request, chunk in zip(posted, chunks):
            try:
                request.wait()
            except OSError:
                failed.update(wanted[i] for i in chunk)
        at = {k: i * size for i, k in enumerate(wanted)}
        return [None if k not in at else self._get(k) if k in failed else self._decode(k, buffer[at[k]:at[k] + size])
                for k in keys]

    def _get(self, key: str) -> TierPage | None:
        import torch

        if key in self._bad:
            return None
        buffer = torch.empty(self.read_size, dtype=torch.uint8)
        try:
            self.store.transfer("READ", buffer, "OBJ", [(0, self.read_size, None, record_name(key))])
        except OSError as exc:
            if self._held([key]) != [False]:  # there, or the bucket does not answer: a failed read
                self._read_failed(f"reading {record_name(key)} from {self.where}: {exc}")
            return None
        return self._decode(key, buffer)

    def _decode(self, key: str, buffer) -> TierPage | None:
        """The record of ``key`` read into ``buffer`` (a host uint8 tensor); a miss where it is not one."""
        try:
            return decode(key, buffer.numpy())
        except ValueError as exc:
            self.rejected += 1
            logger.warning("hierarchical cache: %s in %s is not a record of its key (%s); a miss",
                           record_name(key), self.where, exc)
            self.reject(key)
            return None

    def contains(self, keys: list[str]) -> int:
        held = self._held(keys)
        if held is None:
            self._read_failed(f"asking {self.where} for {len(keys)} records: {self.last_error}")
            return 0
        return next((i for i, h in enumerate(held) if not h), len(keys))

    def reject(self, key: str) -> None:
        self._bad.add(key)

    def _held(self, keys: list[str]) -> list[bool] | None:
        """Which of ``keys`` the bucket holds (a HEAD each: NIXL's query sends its one after another,
        so the keys are split over the lanes, queried side by side), those read bad here not; None
        where it does not answer (``last_error`` says why)."""
        def ask(lane: NixlStore, part: list[str]) -> list:
            return lane.agent.query_memory([(0, 0, i, record_name(k)) for i, k in enumerate(part)], "OBJ", "OBJ")

        try:
            found = [f for part in self._asking.map(ask, self.lanes, _split(keys)) for f in part]
        except Exception as exc:
            self.last_error = f"{type(exc).__name__} {exc}"
            return None
        return [f is not None and k not in self._bad for k, f in zip(keys, found)]


def _split(items: list) -> list[list]:
    """``items`` in up to ``LANES`` runs of nearly equal length, in order."""
    n = min(LANES, len(items))
    return [items[len(items) * j // n:len(items) * (j + 1) // n] for j in range(n)]

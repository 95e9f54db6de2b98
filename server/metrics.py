"""Prometheus metrics of the server, in the text exposition format.

Names follow vLLM's (``engine:`` instead of ``vllm:``) so dashboards carry over. Labels come from
fixed sets (the served model name, the finish reason), so their number is bounded whatever the
requests say. Gauges and the cache/preemption totals are the engine's last reported stats;
token and request counters and latency histograms are counted here, as the API sees each request.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from ..core.kv.hicache_stats import TIERS, HiCacheStats
from .wire import Stats

FINISH_REASONS = ("stop", "length", "abort")
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = _LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, running = [], 0
        for bound, c in zip(self.buckets, self.counts):
            running += c
            out.append(f'{name}_bucket{{{labels},le="{bound}"}} {running}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.count}')
        out.append(f"{name}_sum{{{labels}}} {self.total}")
        out.append(f"{name}_count{{{labels}}} {self.count}")
        return out


class ServerMetrics:
    def __init__(self, model_name: str, page_size: int, num_pages: int) -> None:
        self.labels = f'model_name="{_escape(model_name)}"'
        self.page_size = page_size
        self.num_pages = num_pages
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success = dict.fromkeys(FINISH_REASONS, 0)
        self.rejected_overload = 0
        self.ttft = Histogram()
        self.itl = Histogram()
        self.e2e = Histogram()
        self.queue_time = Histogram()

    def finished(self, reason: str) -> None:
        self.success[reason if reason in self.success else "abort"] += 1

    def render(self, stats: Stats, in_flight: int) -> str:
        L = self.labels
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[str]) -> None:
            lines.extend([f"# HELP engine:{name} {help_}", f"# TYPE engine:{name} {kind}"])
            lines.extend(samples)

        def one(name: str, kind: str, help_: str, value) -> None:
            metric(name, kind, help_, [f"engine:{name}{{{L}}} {value}"])

        one("num_requests_running", "gauge", "Sequences in the running batch.", stats.num_running)
        one("num_requests_waiting", "gauge", "Sequences waiting to be scheduled.", stats.num_waiting)
        one("num_requests_in_flight", "gauge", "Requests the API process is serving.", in_flight)
        one("kv_cache_usage_perc", "gauge", "Fraction of KV pages held by requests (1 = full).", stats.kv_usage)
        one("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
            stats.prefix_cache_queries)
        one("prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits)
        one("num_preemptions_total", "counter", "Sequences preempted to free KV pages.", stats.num_preemptions)
        one("prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", self.prompt_tokens)
        one("generation_tokens_total", "counter", "Tokens generated and delivered.", self.generation_tokens)
        one("request_rejected_overload_total", "counter", "Requests refused with 429 (concurrency limit).",
            self.rejected_overload)
        if (spec := stats.spec) is not None:  # speculative decoding, under vLLM's spec_decode names
            one("spec_decode_num_drafts_total", "counter", "Verified steps of a sequence with drafts.", spec.num_drafts)
            one("spec_decode_num_draft_tokens_total", "counter", "Draft tokens verified.", spec.num_draft_tokens)
            one("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens the target kept.",
                spec.num_accepted_tokens)
            metric("spec_decode_num_accepted_tokens_per_pos", "counter", "Draft tokens kept, by position in the draft.",
                   [f'engine:spec_decode_num_accepted_tokens_per_pos{{{L},position="{i}"}} {c}'
                    for i, c in enumerate(spec.accepted_per_position)])
        if (h := stats.hicache) is not None:
            self._hicache(h, metric)
        if (t := stats.kv_transfer) is not None:  # a decode engine's KV transfers (prefill/decode disaggregation)
            one("kv_transfer_total", "counter", "Prompt KV transfers received whole.", t.num_transfers)
            one("kv_transfer_failed_total", "counter",
                "Prompt KV transfers that failed (checksum, peer, timeout): each prompt computed here instead.",
                t.num_failed)
            one("kv_transfer_pages_total", "counter", "KV pages received.", t.pages_received)
            one("kv_transfer_bytes_total", "counter", "KV bytes received.", t.bytes_received)
            one("kv_transfer_pages_reused_total", "counter", "KV pages not sent: the prefix cache held them.",
                t.pages_reused)
        metric("request_success_total", "counter", "Finished completions by finish reason.",
               [f'engine:request_success_total{{{L},finished_reason="{r}"}} {c}' for r, c in self.success.items()])
        metric("cache_config_info", "gauge", "KV cache configuration.",
               [f'engine:cache_config_info{{{L},page_size="{self.page_size}",num_pages="{self.num_pages}"}} 1'])
        for name, h, help_ in (("time_to_first_token_seconds", self.ttft, "Time to first token."),
                               ("inter_token_latency_seconds", self.itl, "Time between consecutive tokens."),
                               ("e2e_request_latency_seconds", self.e2e, "Request latency, arrival to finish."),
                               ("request_queue_time_seconds", self.queue_time, "Time waiting before first scheduled.")):
            metric(name, "histogram", help_, h.lines(f"engine:{name}", L))
        return "\n".join(lines) + "\n"


    def _hicache(self, h: HiCacheStats, metric) -> None:
        """The hierarchical cache's totals and tier gauges (tiers l1 device, l2 host memory, l3 storage)."""
        L = self.labels

        def per_tier(values: dict[str, int], extra: str = "") -> list[str]:
            return [f'{{{L},tier="{t}"{extra}}} {values[t]}' for t in TIERS if t in values]

        def samples(name: str, values: dict[str, int], extra: str = "") -> list[str]:
            return [f"engine:{name}{s}" for s in per_tier(values, extra)]

        metric("hicache_hit_tokens_total", "counter", "Prefix tokens hit, by the tier they were found in.",
               samples("hicache_hit_tokens_total", h.hit_tokens))
        metric("hicache_bytes_total", "counter", "KV bytes into (write) and out of (read) each tier below the device.",
               samples("hicache_bytes_total", h.bytes_written, ',direction="write"')
               + samples("hicache_bytes_total", h.bytes_read, ',direction="read"'))
        metric("hicache_checksum_failures_total", "counter",
               "Records that failed their checksum or were not a record of their key (each a miss, recomputed).",
               [f"engine:hicache_checksum_failures_total{{{L}}} {h.checksum_failures}"])
        metric("hicache_storage_failures_total", "counter",
               "Storage-tier writes and reads that failed (a full disk, an unreachable store).",
               [f"engine:hicache_storage_failures_total{{{L}}} {h.storage_failures}"])
        metric("hicache_storage_dropped_total", "counter",
               "Records never written to the storage tier: its writer's queue was full, or the tier had failed.",
               [f"engine:hicache_storage_dropped_total{{{L}}} {h.storage_dropped}"])
        metric("hicache_used_bytes", "gauge", "Bytes each tier holds (l3: its file system's, where it is one).",
               samples("hicache_used_bytes", h.used_bytes))
        metric("hicache_capacity_bytes", "gauge", "Bytes each tier can hold (l3: its file system's size).",
               samples("hicache_capacity_bytes", h.capacity_bytes))
        metric("hicache_storage_attached", "gauge", "Whether a storage tier (L3) is attached, by backend.",
               [f'engine:hicache_storage_attached{{{L},backend="{_escape(h.storage_backend or "")}"}} '
                f"{int(h.storage_backend is not None)}"])
        for event, help_ in (("written", "A proposer's rows records (DSpark's context rows) written below the device."),
                             ("read", "Rows records given back to the proposer for a prefix hit."),
                             ("missed", "Rows a prefix hit's pages lacked: absent below the device, of another "
                                        "drafter, or failing their checksum (drafted without them).")):
            if event in h.rows:
                metric(f"hicache_rows_{event}_total", "counter", help_,
                       [f"engine:hicache_rows_{event}_total{{{L}}} {h.rows[event]}"])


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

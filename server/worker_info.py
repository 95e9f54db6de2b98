"""What a gateway asks of a worker: server and model info, and the worker's load.

The gateway (SGLang's ``smg``, launched by ``engine gateway``) registers a worker by probing
``/health``, ``/v1/models`` and ``/server_info`` (``/model_info`` for labels), then polls
``/v1/loads`` for its load-aware policies. The engine answers as an SGLang worker does: the
gateway tells engines apart by ``/version`` (vLLM's) against ``/server_info`` (SGLang's), and an
SGLang runtime is the one whose prefill/decode protocol (bootstrap host, port and room in each
request) the engine speaks, so this server has no ``/version``. The ``get_`` spellings are older
routers' names. Every route here is behind the API key, which the gateway sends when given one.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI

from .. import __version__
from ..core.disagg.config import DisaggConfig
from .wire import Stats


@dataclass(frozen=True)
class WorkerInfo:
    model_path: str
    served_model_name: str
    architectures: list[str]
    model_type: str | None
    max_model_len: int
    page_size: int
    num_pages: int
    max_running_requests: int
    max_prefill_tokens: int
    disaggregation_mode: str = "null"  # SGLang's spelling of "neither prefill nor decode"
    bootstrap_port: int | None = None

    @classmethod
    def of(cls, model_path: str, served_model_name: str, **fields) -> "WorkerInfo":
        hf = json.loads((Path(model_path) / "config.json").read_text())
        return cls(model_path=str(model_path), served_model_name=served_model_name,
                   architectures=list(hf.get("architectures") or []), model_type=hf.get("model_type"), **fields)

    @property
    def max_total_tokens(self) -> int:
        return self.page_size * self.num_pages

    def server_info(self) -> dict:
        return {"model_path": self.model_path, "served_model_name": self.served_model_name, "version": __version__,
                "dp_size": 1, "tp_size": 1, "page_size": self.page_size, "context_length": self.max_model_len,
                "max_total_num_tokens": self.max_total_tokens, "max_total_tokens": self.max_total_tokens,
                "max_running_requests": self.max_running_requests, "max_prefill_tokens": self.max_prefill_tokens,
                "disaggregation_mode": self.disaggregation_mode,
                "disaggregation_bootstrap_port": self.bootstrap_port}

    def model_info(self) -> dict:
        return {"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
                "model_type": self.model_type, "architectures": self.architectures}

    def loads(self, stats: Stats) -> dict:
        """The gateway's load schema (one data-parallel rank) from the engine's last reported stats."""
        hit_rate = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
        rank = {"dp_rank": 0, "num_running_reqs": stats.num_running, "num_waiting_reqs": stats.num_waiting,
                "num_total_reqs": stats.num_running + stats.num_waiting,
                "num_used_tokens": round(stats.kv_usage * self.max_total_tokens),
                "max_total_num_tokens": self.max_total_tokens, "token_usage": stats.kv_usage,
                "cache_hit_rate": hit_rate, "max_running_requests": self.max_running_requests,
                "disagg_mode": self.disaggregation_mode}
        now = datetime.datetime.now(datetime.timezone.utc).isoformat()
        return {"timestamp": now, "version": __version__, "dp_rank_count": 1, "loads": [rank]}


def worker_disagg(disagg: DisaggConfig | None) -> dict:
    """WorkerInfo's disaggregation fields for a server's settings."""
    if disagg is None:
        return {}
    return {"disaggregation_mode": disagg.mode,
            "bootstrap_port": disagg.bootstrap_port if disagg.mode == "prefill" else None}


def add_worker_routes(app: FastAPI, state) -> None:
    """GET /server_info, /model_info (and their ``get_`` names) and /v1/loads on ``app``."""

    async def server_info() -> dict:
        return state.worker.server_info()

    async def model_info() -> dict:
        return state.worker.model_info()

    async def loads() -> dict:
        return state.worker.loads(state.serving.client.stats)

    for path, handler in (("/server_info", server_info), ("/get_server_info", server_info),
                          ("/model_info", model_info), ("/get_model_info", model_info), ("/v1/loads", loads)):
        app.add_api_route(path, handler, methods=["GET"])

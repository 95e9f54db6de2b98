"""Prefill/decode disaggregation at the HTTP edge: the serve flags, and the bootstrap fields the
gateway adds to each request (SGLang's ``bootstrap_host``, ``bootstrap_port``, ``bootstrap_room``;
one of each for a single prompt, a list of one per prompt for several).

They are checked here, before anything reaches the engine: all three or none; on a prefill or
decode server, required; elsewhere, refused; ports in range, rooms unsigned 63-bit, and the host
one the decode engine may connect to (``--disaggregation-allowed-hosts``, loopback by default: a
client must not make the server connect where it likes).
"""

from __future__ import annotations

import argparse
import os

from ..core.disagg.config import LOOPBACK_HOSTS, DisaggConfig
from ..core.families.kv_transport import KVPeer
from .errors import invalid

FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


def add_disagg_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prefill/decode disaggregation (behind `engine gateway --pd-disaggregation`)")
    g.add_argument("--disaggregation-mode", choices=["null", "prefill", "decode"], default="null",
                   help="prefill: run prompts and hand their KV pages on; decode: take them and generate")
    g.add_argument("--disaggregation-transfer-backend", default="tcp", help="a kv_transport (`engine plugins`)")
    g.add_argument("--disaggregation-bootstrap-port", type=int, default=8998,
                   help="prefill: the port decode engines fetch KV pages from")
    g.add_argument("--disaggregation-bootstrap-host", default="127.0.0.1", help="prefill: the address it binds")
    g.add_argument("--disaggregation-allowed-hosts", default=",".join(LOOPBACK_HOSTS),
                   help="decode: comma-separated bootstrap hosts a request may name")
    g.add_argument("--disaggregation-secret", default=os.environ.get("ENGINE_KV_SECRET"),
                   help="shared by prefill and decode engines to authenticate transfers "
                        "(default: $ENGINE_KV_SECRET, else the API key)")
    g.add_argument("--disaggregation-timeout", type=float, default=300.0,
                   help="seconds a room waits for its other side; unfetched pages are dropped after it")


def disagg_config(args: argparse.Namespace) -> DisaggConfig | None:
    if args.disaggregation_mode == "null":
        return None
    hosts = tuple(h.strip() for h in args.disaggregation_allowed_hosts.split(",") if h.strip())
    return DisaggConfig(mode=args.disaggregation_mode, transfer_backend=args.disaggregation_transfer_backend,
                        bootstrap_port=args.disaggregation_bootstrap_port,
                        bootstrap_host=args.disaggregation_bootstrap_host, allowed_hosts=hosts,
                        secret=args.disaggregation_secret or args.api_key or "", timeout=args.disaggregation_timeout)


def kv_peers(req, count: int, disagg: DisaggConfig | None) -> list[KVPeer | None]:
    """One peer per prompt (``count`` of them) from the request's bootstrap fields; 400 naming the field."""
    given = {f: getattr(req, f) for f in FIELDS if getattr(req, f) is not None}
    if disagg is None:
        if given:
            raise invalid(next(iter(given)), f"{next(iter(given))}: this server is not a prefill or decode server")
        return [None] * count
    missing = [f for f in FIELDS if f not in given]
    if missing:
        raise invalid(missing[0], f"{missing[0]} is required: a {disagg.mode} server serves requests the gateway "
                                  "sends with bootstrap_host, bootstrap_port and bootstrap_room")
    columns = {}
    for f, value in given.items():
        values = value if isinstance(value, list) else [value]
        if len(values) != count:
            raise invalid(f, f"{f} has {len(values)} entries for {count} prompts: a list of one per prompt")
        columns[f] = values
    peers = []
    for host, port, room in zip(columns["bootstrap_host"], columns["bootstrap_port"], columns["bootstrap_room"]):
        if host not in disagg.allowed_hosts:
            raise invalid("bootstrap_host", f"bootstrap_host {host[:100]!r} is not one this server may connect to "
                                            "(--disaggregation-allowed-hosts)")
        if not 1 <= port < 2**16:
            raise invalid("bootstrap_port", f"bootstrap_port must be in [1, 65535], got {port}")
        if not 0 <= room < 2**63:
            raise invalid("bootstrap_room", f"bootstrap_room must be in [0, 2**63), got {room}")
        peers.append(KVPeer(host, port, room))
    return peers

"""Mooncake's settings, one set for the storage tier (mooncake.py) and the KV transport
(mooncake_kv.py): ``plugin_options["mooncake"]``, else the environment SGLang's integration reads,
else the default. ``master_server_address`` (MOONCAKE_MASTER; the store's), ``metadata_server``
(MOONCAKE_TE_META_DATA_SERVER, default "P2PHANDSHAKE"), ``local_hostname`` (MOONCAKE_LOCAL_HOSTNAME,
default "localhost": the name peers reach this engine by), ``protocol`` (MOONCAKE_PROTOCOL, "tcp"),
``device_name`` (MOONCAKE_DEVICE, "" picks RDMA devices itself), ``global_segment_size`` and
``local_buffer_size`` (bytes; 4 GiB and 512 MiB; the store's).
"""

from __future__ import annotations

import os

SETTINGS = {  # option: (environment variable, default)
    "master_server_address": ("MOONCAKE_MASTER", None),
    "metadata_server": ("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE"),
    "local_hostname": ("MOONCAKE_LOCAL_HOSTNAME", "localhost"),
    "protocol": ("MOONCAKE_PROTOCOL", "tcp"),
    "device_name": ("MOONCAKE_DEVICE", ""),
    "global_segment_size": ("MOONCAKE_GLOBAL_SEGMENT_SIZE", 4 * 2**30),
    "local_buffer_size": ("MOONCAKE_LOCAL_BUFFER_SIZE", 512 * 2**20),
}


def mooncake_settings(ctx) -> dict:
    options = (getattr(ctx.engine_config, "plugin_options", None) or {}).get("mooncake", {})
    return {k: options.get(k, os.environ.get(env, default)) for k, (env, default) in SETTINGS.items()}

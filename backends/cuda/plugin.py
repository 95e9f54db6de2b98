"""The NVIDIA backend as a plugin, registered through ``engine.plugins`` like any third party.

It claims the machine when torch sees a CUDA device. Importing this module imports no vendor
library: cuda-python is imported inside detection, and only where torch has found a device.
"""

from __future__ import annotations

from engine.core.hookspecs import hookimpl
from engine.core.platform import PlatformSpec

from . import platform


@hookimpl
def engine_detect_platform() -> PlatformSpec | None:
    return platform.detect()

"""DeepSeek-V3.2's tool calls: DeepSeek-V4's DSML (server/tool_parsers/deepseek_v4.py) in a block named
``function_calls`` (its published encoding, encoding/encoding_dsv32.py):

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>
"""

from __future__ import annotations

from .deepseek_v4 import DSML, DeepSeekV4Format


class DeepSeekV32Format(DeepSeekV4Format):
    name = "deepseek_v32"
    block_start = f"<{DSML}function_calls>"
    block_end = f"</{DSML}function_calls>"
    template_markers = (f"{DSML}function_calls",)

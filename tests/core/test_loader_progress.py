"""The weight-loading progress bar ends its line, so the log line after it starts on its own."""

from __future__ import annotations

from engine.core.loader import iter_checkpoint


def test_the_loading_bar_ends_its_line(tiny_qwen3, capsys):
    names = [name for name, _ in iter_checkpoint(tiny_qwen3, progress=True)]
    err = capsys.readouterr().err
    assert names and "loading weights" in err
    assert err.endswith("\n") and f"{len(names)}/{len(names)}" in err.splitlines()[-1]

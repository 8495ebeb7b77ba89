"""Progress bars: shown for slow legalization/compilation on a terminal, silent otherwise."""

from __future__ import annotations

import io

import pytest

from optimum_ipu_backend.runtime import progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_enabled_only_on_a_terminal_and_not_when_turned_off(monkeypatch):
    monkeypatch.delenv(progress.PROGRESS_ENV, raising=False)
    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert progress.progress_enabled() is False
    monkeypatch.setattr("sys.stderr", _Terminal())
    assert progress.progress_enabled() is True
    monkeypatch.setenv(progress.PROGRESS_ENV, "0")
    assert progress.progress_enabled() is False
    assert progress.progress_enabled(True) is True  # the provider option wins


@pytest.mark.parametrize("enabled", [True, False])
def test_a_slow_step_draws_a_bar_only_when_enabled(monkeypatch, enabled):
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    monkeypatch.setattr(progress, "DELAY_SECONDS", 0.0)  # every step counts as slow here
    with progress.step_progress("legalizing for {'input_ids': (1, 8)}", 3, enabled) as advance:
        for label in ("fix_shapes", "fold_constants", "verify"):
            advance(label)
    output = terminal.getvalue()
    assert ("legalizing" in output and "/3 " in output) is enabled
    assert (output == "") is (not enabled)

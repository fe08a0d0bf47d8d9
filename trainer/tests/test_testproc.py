"""The test harness's own helpers."""

from __future__ import annotations

from testproc import complete_lines, port_in


def test_a_line_still_being_written_is_not_read():
    # Seen under load: the log was read mid-write and this piece had no port.
    partial = "starting\nlakecache worker listening on https://127.0.0."
    assert complete_lines(partial) == ["starting"]
    whole = partial + "1:40123\n"
    line = next(x for x in complete_lines(whole) if "listening on" in x)
    assert port_in(line) == 40123
    assert complete_lines("no newline yet") == []

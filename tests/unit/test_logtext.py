"""Unit tests for h5serve.util.logtext: user text never breaks a log line."""

from __future__ import annotations

import io
import logging

import pytest

from h5serve.util.logtext import EscapingFilter, printable


@pytest.mark.parametrize("value, shown", [
    ("/data/train.h5", "/data/train.h5"),
    ("/données/é.h5", "/données/é.h5"),  # printable UTF-8 as it is
    ("a\nb", "a\\x0ab"), ("a\rb", "a\\x0db"), ("tab\there", "tab\\x09here"), ("\x1b[31m", "\\x1b[31m"),
    ("a\u2028b", "a\\u2028b"), ("\u202eevil", "\\u202eevil"),  # line separator, bidi override
    ("back\\slash\n", "back\\\\slash\\x0a"),  # a literal backslash cannot pose as an escape
    (b"/x/\xff.h5", "/x/\\udcff.h5"),  # undecodable bytes (surrogateescape)
])
def test_printable_is_one_unambiguous_line(value: object, shown: str) -> None:
    assert printable(value) == shown
    assert printable(value).isprintable()


def test_the_filter_escapes_messages_and_indents_tracebacks() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(EscapingFilter())
    logger = logging.getLogger("h5serve.test_logtext")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("loading %s", "/x\nFORGED line")
        try:
            raise ValueError("bad\nFORGED too")
        except ValueError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    lines = out.getvalue().splitlines()
    assert lines[0] == "loading /x\\x0aFORGED line"
    assert not [line for line in lines if line.startswith("FORGED")], lines
    assert lines[1:3] == ["failed", "Traceback (most recent call last):"], lines
    assert all(line.startswith("    ") for line in lines[3:]), lines


def test_printable_lines_keeps_lines_escapes_each_and_indents_the_rest() -> None:
    from h5serve.util.logtext import printable_lines

    text = printable_lines("cannot read '/x\\ny': no such file\nhint: check /a\x1b]0;t\x07\rFORGED")
    assert text == "cannot read '/x\\ny': no such file\n    hint: check /a\\x1b]0;t\\x07\\x0dFORGED"

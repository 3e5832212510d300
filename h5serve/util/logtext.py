"""Text from users in log lines: paths, keys and file names are user-supplied (a request, a
name someone planted in the shm dir), and a newline in one would forge a log line of its own.

``printable`` escapes every character that is not printable (controls, line and paragraph
separators, bidi overrides, lone surrogates from undecodable bytes) and the backslash, so a
logged value is one line and reads back unambiguously. The daemon's log calls pass user
strings through it; ``EscapingFilter`` on the daemon's log handlers is the net under them:
any message that still holds such a character is escaped whole, and a traceback's lines after
its first are indented (``printable_lines``), so no text from an exception message can start a line.

The command line's text for a terminal (``h5serve status``, ``inspect``, ``preload``, its error
messages) escapes user text with the same two: an ESC, CR or BEL in a member's file name would
otherwise drive the terminal of whoever reads it (retitle it, overwrite a row), a newline forge a row.
"""

from __future__ import annotations

import logging
import os
import traceback

__all__ = ["printable", "printable_lines", "EscapingFilter"]


def _escape(char: str) -> str:
    code = ord(char)
    if char == "\\":
        return "\\\\"
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(value: object) -> str:
    """``value`` as text on one line: every non-printable character (and ``\\``) escaped,
    ``\\n`` as ``\\x0a``; printable text (UTF-8 names included) as it is."""
    text = os.fsdecode(value) if isinstance(value, (bytes, os.PathLike)) else str(value)
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(c if c.isprintable() and c != "\\" else _escape(c) for c in text)


def printable_lines(text: str, indent: str = "    ") -> str:
    """``text`` (several lines: a traceback, an error message with a hint below it) kept on its
    own lines, each that is not printable escaped (``printable``), every one after the first
    indented by ``indent``: no part of it can pass for a line of its own."""
    lines = (line if line.isprintable() else printable(line) for line in text.split("\n"))
    return ("\n" + indent).join(lines)


class EscapingFilter(logging.Filter):
    """For a log handler: a message with a non-printable character is escaped whole
    (``printable``); a traceback keeps its lines, each after the first indented."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.isprintable():
            record.msg, record.args = printable(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = printable_lines("".join(traceback.format_exception(*record.exc_info)).rstrip("\n"))
        return True

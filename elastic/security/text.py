"""Text from the network made safe to log, journal and print: control
characters replaced, length capped, so that it cannot forge log lines or
drive an operator's terminal (escape sequences)."""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")


def clean_text(text: str, limit: int, keep_newlines: bool = False) -> str:
    """`text` with control characters replaced by U+FFFD (newlines and tabs
    kept with `keep_newlines`, else turned into spaces), cut to its last
    `limit` characters."""
    if not keep_newlines:
        text = text.replace("\n", " ").replace("\t", " ")
    return _CONTROL.sub("\ufffd", text[-limit:])

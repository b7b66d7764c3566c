"""Credentials out of text: URL user-info and query strings (signatures, tokens, upload ids).

:func:`redact` cleans one string, so that no credential reaches a message or a log line;
:func:`redact_transport_logs` does it to urllib3's debug records.
"""

from __future__ import annotations

import logging
import re

__all__ = ["redact", "redact_transport_logs"]

# up to the authority's last "@", as urlsplit reads it: a password may hold an unencoded "@"
_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/?#\s'\"]*@")
_QUERY = re.compile(r"(?P<url>[a-zA-Z][a-zA-Z0-9+.-]*://[^\s?'\"]*|/[^\s?'\"]*)\?[^\s'\"#)]*")


def redact(text: str) -> str:
    """``text`` with URL user-info and query strings replaced by ``***``."""
    text = _USERINFO.sub(r"\g<scheme>***@", text)
    return _QUERY.sub(r"\g<url>?***", text)


class _RedactingFilter(logging.Filter):
    """Redacts a record's message (see :func:`redact`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, ()
        return True


def redact_transport_logs() -> None:
    """urllib3 logs every request's path and query at DEBUG: a GCS upload session's id (a
    bearer credential), an http(s) root's token. Redact that logger's records (in this
    process, for every user of urllib3: its debug lines then show queries as ``***``)."""
    logger = logging.getLogger("urllib3.connectionpool")
    if not any(isinstance(f, _RedactingFilter) for f in logger.filters):
        logger.addFilter(_RedactingFilter())

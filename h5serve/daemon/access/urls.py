"""Which object-store URLs a daemon fetches, and for whom (docs/security.md, *Remote files*).

A daemon fetches an ``s3://`` object with its own user's credentials (the standard chain:
environment, ``~/.aws``, the instance role); the client never sends any. So:

- a **personal daemon** (run by a user for themself: no ``--group``, not root) fetches any
  URL its credentials can read: whoever connects is that same user, who could read it anyway;
- a **shared daemon** (``--group``, or run as root, which serves every local user) fetches
  only URLs under a prefix its admin named with ``--allow-url s3://bucket/prefix/``
  (repeatable); anything else is AccessDenied naming the flag. Without the list a member could
  read, through the daemon, a bucket only the daemon's credentials may read.

A prefix is matched by whole path components (``s3://b/data/`` allows ``s3://b/data/x.h5``,
never ``s3://b/database.h5``), on URLs with no ``.``/``..`` component, no empty component, no
query, fragment or user info (an HTTP client may normalise ``a/../b`` to ``b``, escaping the
prefix).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ...errors import AccessDenied, ConfigError
from ...hdf5.remote import shown_url
from ...wire.protocol import REMOTE_PREFIXES

__all__ = ["UrlPolicy", "parse_allow_url", "check_url_shape"]


def check_url_shape(url: str) -> str:
    """``url`` if it is an ``s3://bucket/key`` the daemon may fetch (see the module); its
    ``bucket/key``.

    Raised otherwise: AccessDenied saying why."""
    if not url.startswith(REMOTE_PREFIXES):
        raise AccessDenied(f"{shown_url(url)}: the daemon fetches {', '.join(REMOTE_PREFIXES)} URLs only")
    rest = url.split("://", 1)[1]
    parts = rest.split("/")
    if (len(parts) < 2 or any(p in ("", ".", "..") for p in parts) or any(c in rest for c in "?#@\\")
            or any(ord(c) < 32 for c in rest)):
        raise AccessDenied(f"{shown_url(url)}: the daemon fetches only plain s3://bucket/key URLs (no empty, '.' or "
                           "'..' component, no query, fragment or user info)")
    return rest


def parse_allow_url(text: str) -> str:
    """An ``--allow-url`` value as a prefix ending in ``/`` (``s3://bucket/`` or
    ``s3://bucket/prefix/``).

    Raised when it is not one: ConfigError."""
    if not text.startswith(REMOTE_PREFIXES):
        raise ConfigError(f"--allow-url {text!r}: give an s3:// prefix, e.g. s3://bucket/datasets/")
    prefix = text if text.endswith("/") else text + "/"
    try:
        check_url_shape(prefix + "x")
    except AccessDenied as exc:
        raise ConfigError(f"--allow-url {text!r}: {exc}") from None
    return prefix


@dataclass(frozen=True)
class UrlPolicy:
    """``allow``: the ``--allow-url`` prefixes (each ending in ``/``); ``shared``: whether the
    daemon serves users other than its own (``--group``, or root)."""

    allow: tuple[str, ...] = ()
    shared: bool = False

    @classmethod
    def of(cls, allow: tuple[str, ...], group: int | None) -> UrlPolicy:
        return cls(tuple(parse_allow_url(a) for a in allow), group is not None or os.geteuid() == 0)

    def check(self, url: str) -> None:
        """Raised when this daemon may not fetch ``url``: AccessDenied naming ``--allow-url``."""
        check_url_shape(url)
        if self.allow and any(url.startswith(prefix) for prefix in self.allow):
            return
        if self.allow or self.shared:
            allowed = ", ".join(self.allow) if self.allow else "none"
            raise AccessDenied(
                f"{shown_url(url)} is not under the daemon's --allow-url prefixes ({allowed}): a shared daemon "
                "(--group, or run as root) fetches with its own credentials only what its admin allowed; ask them to "
                "add it (h5serve start --allow-url s3://bucket/prefix/), or read it lazily with your own credentials "
                "(fallback='lazy', the default)")

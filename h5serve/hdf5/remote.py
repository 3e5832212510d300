"""Remote HDF5 files: ``s3://bucket/key.h5``, ``gs://...``, ``https://host/path.h5``, read by h5py
through h5serve's file object over fsspec's filesystems (docs/architecture.md, *Remote files*).

- ``is_url`` / ``parse_url``: which names are URLs, and whether h5serve reads their scheme.
- ``RemoteIdentity``: what a remote file is (URL, size, ETag, version id); taken when the job
  describes its files, checked again at every later open (``open_remote(url, pin=...)``), so a
  worker never reads a rewritten object under the old description.
- ``open_remote``: a read-only, seekable file object for ``h5py.File(fileobj)``, with a bounded
  block cache (``BLOCK_BYTES`` x ``CACHE_BLOCKS`` per open file), whose requests the reading
  thread runs itself (threadloop.py: h5py deadlocks with a service thread's garbage collection).
  On S3 every range request carries ``If-Match: <ETag>``, so once the object changes a read
  fails with SourceChanged instead of mixing two versions.
- ``remote_call``: one policy of retries (RETRY: exponential backoff with full jitter, a
  deadline) for transient failures (5xx, 429 and S3's SlowDown, timeouts, connection resets,
  responses cut short); the libraries below are told not to retry themselves, so a read is
  retried by one policy, not three stacked ones.
- ``remote_error``: any failure of fsspec, s3fs, botocore or aiohttp as h5serve's class
  (ObjectNotFound, ObjectAccessDenied, SourceChanged, ObjectStoreError) with a message naming
  the URL (query strings and user info cut off) and the HTTP status, and never a credential.

fsspec and its backends (s3fs, gcsfs, aiohttp) are optional (``pip install 'h5serve[s3]'``)
and imported only when a URL is opened. Credentials come from each backend's standard chain
(S3: environment, ``~/.aws``, instance roles; an endpoint of another store: ``AWS_ENDPOINT_URL``);
h5serve never reads, stores or prints them.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import random
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import (
    ConfigError,
    H5ServeError,
    ObjectAccessDenied,
    ObjectNotFound,
    ObjectStoreError,
    SourceChanged,
)
from .threadloop import filesystem_here, run_here

__all__ = [
    "SCHEMES",
    "BLOCK_BYTES",
    "CACHE_BLOCKS",
    "METADATA_BLOCK_BYTES",
    "METADATA_CACHE_BLOCKS",
    "RETRY",
    "RetryPolicy",
    "RemoteIdentity",
    "RemoteFile",
    "is_url",
    "parse_url",
    "shown_url",
    "remote_identity",
    "filesystem_of",
    "open_remote",
    "remote_call",
    "remote_error",
    "expand_url_pattern",
    "s3_get_range",
]

log = logging.getLogger("h5serve.remote")
T = TypeVar("T")

# scheme -> the pip extra that brings its fsspec backend (named in the error when it is missing)
SCHEMES = {"s3": "s3", "gs": "gcs", "gcs": "gcs", "http": "http", "https": "http"}
BLOCK_BYTES = 2 << 20  # one range request: large enough for HDF5's chunk reads, small for its metadata reads
CACHE_BLOCKS = 16  # blocks kept per open file (least recently used dropped): at most 32 MiB a file
# an open for HDF5's metadata only (describing a file, the daemon's inspection and loads): small requests, so
# that metadata costs little beside the rows (each rank describes its files; the daemon fetches the rows once)
# (a 12 MiB file: its datasets described in 32 KiB, 128 KiB with 64 KiB blocks and 4 MiB with 2 MiB ones; 16 KiB
# holds a B-tree node of HDF5's chunk index whole; 8 KiB saved 0.1 MB more for 10 more requests on the same file)
METADATA_BLOCK_BYTES = 16 << 10
METADATA_CACHE_BLOCKS = 512  # 8 MiB at most per open
FETCH_AT_ONCE = 8  # a read's missing blocks: requests in flight at most
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 60.0  # one request, once connected
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.S)
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_TRANSIENT_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError",
                              "ServiceUnavailable", "RequestTimeTooSkewed"})
# exception classes (by name: their modules are optional) that mean the connection, not the request, failed
_TRANSIENT_NAMES = frozenset({"TimeoutError", "ConnectionError", "ClientPayloadError", "ServerDisconnectedError",
                              "ClientConnectionError", "ClientOSError", "HTTPClientError", "EndpointConnectionError",
                              "ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError", "IncompleteRead",
                              "FSTimeoutError", "ResponseParserError", "IncompleteReadError"})
_SECRET_VARS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")


@dataclass(frozen=True)
class RetryPolicy:
    """Transient failures are tried again ``attempts`` times in all, waiting a random time up to
    ``first_s * 2**n`` (at most ``cap_s``) before try ``n + 1``, and never past ``deadline_s``
    from the first try."""

    attempts: int = 6
    first_s: float = 0.2
    cap_s: float = 10.0
    deadline_s: float = 120.0

    def wait(self, attempt: int) -> float:
        return random.uniform(0, min(self.cap_s, self.first_s * 2 ** attempt))


RETRY = RetryPolicy()


@dataclass(frozen=True)
class RemoteIdentity:
    """What a remote file is: its URL, size, ETag and version id ("" when the store gives none).
    Equal identities: the same bytes (an ETag changes with the object; an https server that
    gives no ETag is checked by size alone)."""

    url: str
    size: int
    etag: str = ""
    version_id: str = ""

    @classmethod
    def of(cls, url: str, info: dict[str, Any]) -> RemoteIdentity:
        """From fsspec's ``info`` of the object (s3fs: ``ETag``, ``VersionId``; http: ``ETag``)."""
        etag = info.get("ETag") or info.get("etag") or info.get("md5Hash") or ""
        version = info.get("VersionId") or info.get("generation") or ""
        return cls(url, int(info.get("size") or 0), str(etag), str(version))

    def describe(self) -> str:
        parts = [f"{self.size:,} bytes"]
        if self.etag:
            parts.append(f"ETag {self.etag}")
        if self.version_id:
            parts.append(f"version {self.version_id}")
        return ", ".join(parts)


def is_url(path: object) -> bool:
    """True for ``scheme://...`` (any scheme: ``parse_url`` says whether h5serve reads it);
    False for local paths, including ``file://``-less relative ones."""
    return isinstance(path, str) and _URL.match(path) is not None and not path.startswith("file://")


def parse_url(url: str) -> tuple[str, str]:
    """``(scheme, path)`` of a URL h5serve reads: the path as fsspec takes it (``bucket/key`` for
    s3 and gs, the whole URL for http and https).

    Raised for a scheme h5serve does not read, or no bucket and key: ConfigError."""
    match = _URL.match(url)
    if match is None:
        raise ConfigError(f"{shown_url(url)!r} is not a URL")
    scheme, rest = match[1].lower(), match[2]
    if scheme not in SCHEMES:
        raise ConfigError(f"{shown_url(url)!r}: h5serve reads files from {', '.join(sorted(SCHEMES))} URLs and "
                          f"local paths, not {scheme}://")
    if scheme in ("http", "https"):
        return scheme, url
    if "/" not in rest.strip("/") or not rest.split("/", 1)[0]:
        raise ConfigError(f"{shown_url(url)!r} names no object: write {scheme}://bucket/path/file.h5")
    return scheme, rest


def shown_url(url: str) -> str:
    """``url`` as messages show it: no user info (``user:pass@``), no query string (a presigned
    URL's signature) or fragment."""
    match = _URL.match(url)
    if match is None:
        return url
    rest = re.sub(r"^[^/@]*@", "", match[2])
    return f"{match[1]}://{re.split(r'[?#]', rest, maxsplit=1)[0]}"


def _scrub(text: str) -> str:
    """``text`` without any credential value this process holds in its environment, and without
    the query string of any URL in it (a presigned URL's signature)."""
    text = re.sub(r"(\b[A-Za-z][A-Za-z0-9+.-]*://[^\s?#'\"()]+)[?#][^\s'\"()]*", r"\1", text)
    for name in _SECRET_VARS:
        value = os.environ.get(name)
        if value and len(value) >= 4:
            text = text.replace(value, "***")
    return text


def _options(scheme: str) -> dict[str, Any]:
    """fsspec's options for ``scheme``: told not to retry (``remote_call`` does), bounded waits."""
    options: dict[str, Any] = {}
    if scheme == "s3":
        options["config_kwargs"] = {"connect_timeout": CONNECT_TIMEOUT_S, "read_timeout": READ_TIMEOUT_S,
                                    "retries": {"total_max_attempts": 1}}
        # botocore reads these too; named here as well because fsspec keys its cached instances by
        # their options: a process that changes the endpoint gets a filesystem on the new one
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            options["endpoint_url"] = endpoint
    return options


def _missing_backend(scheme: str, exc: ImportError) -> ConfigError:
    extra = SCHEMES[scheme]
    if exc.name == "fsspec":
        return ConfigError(f"reading {scheme}:// files needs fsspec: pip install 'h5serve[{extra}]'")
    return ConfigError(f"reading {scheme}:// files needs fsspec's {scheme} backend ({exc.name or exc}): "
                       f"pip install 'h5serve[{extra}]'")


def _filesystem(scheme: str) -> Any:
    """fsspec's filesystem for ``scheme`` (one per process: fsspec caches instances by their
    options and makes new ones after a fork), told not to retry (``remote_call`` does). Its
    requests run on fsspec's service thread: never call it from a file object h5py reads
    (threadloop.py says why).

    Raised when fsspec or the scheme's backend is not installed: ConfigError naming the extra."""
    try:
        import fsspec

        fs = fsspec.filesystem(scheme, **_options(scheme))
    except ImportError as exc:
        raise _missing_backend(scheme, exc) from exc
    return _one_try(scheme, fs)


def _one_try(scheme: str, fs: Any) -> Any:
    """``fs`` with s3fs's own loop around each request set to one try (remote_call retries)."""
    if scheme == "s3":
        fs.retries = 1  # a class attribute of s3fs's, not an option it takes
    return fs


def filesystem_of(scheme: str) -> Any:
    """fsspec's filesystem for ``scheme`` as ``open_remote`` uses it (told not to retry).

    Raised when its backend is not installed: ConfigError naming the extra."""
    return _filesystem(scheme)


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    while exc is not None and exc not in out and len(out) < 8:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return out


def _status(chain: list[BaseException]) -> tuple[int | None, str]:
    """The HTTP status and the store's error code, from the first exception in ``chain`` that
    carries a response (botocore's ClientError) or a status (aiohttp's ClientResponseError)."""
    for exc in chain:
        response = getattr(exc, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = str(response.get("Error", {}).get("Code", ""))
            if status is None and code.isdigit():
                status = int(code)
            return (int(status) if status is not None else None), code
        status = getattr(exc, "status", None)  # not ``code``: aiohttp's parser errors carry a made-up 400 there
        if isinstance(status, int) and 100 <= status < 600:
            return status, ""
    return None, ""


def _is_transient(chain: list[BaseException], status: int | None, code: str) -> bool:
    if status in _TRANSIENT_STATUS or code in _TRANSIENT_CODES:
        return True
    if status is not None:
        return False
    names = {cls.__name__ for exc in chain for cls in type(exc).__mro__}
    return bool(names & _TRANSIENT_NAMES) and not isinstance(chain[0], (FileNotFoundError, PermissionError))


def remote_error(exc: BaseException, url: str, doing: str, tries: int = 1) -> H5ServeError:
    """h5serve's error for ``exc``, met while ``doing`` (``"reading"``) ``url``; ``tries``: how
    many times it was tried. An H5ServeError is returned as it is."""
    if isinstance(exc, H5ServeError):
        return exc
    chain = _chain(exc)
    status, code = _status(chain)
    where = shown_url(url)
    what = f"HTTP {status}" + (f" {code}" if code and code != str(status) else "") if status else type(exc).__name__
    reason = _scrub(str(exc)) or type(exc).__name__
    if any(type(e).__name__ == "FileExpired" for e in chain) or status == 412:
        return SourceChanged(f"{where} changed while this job was reading it (the store no longer holds the version "
                             "it opened): restart the job to read the new object, and write new data under new keys "
                             "rather than over objects a job reads")
    if status == 404 or (status is None and isinstance(chain[0], FileNotFoundError)):
        fix = ("check the URL" if where.startswith(("http://", "https://")) else
               "check the URL, and AWS_ENDPOINT_URL for a store other than AWS")
        return ObjectNotFound(f"{doing} {where} failed: {what}: the object or its bucket does not exist ({reason}); "
                              f"{fix}", url=where, status=status or 404)
    if status in (401, 403) or (status is None and isinstance(chain[0], PermissionError)):
        fix = ("the server refused it: the object may not be public, or a presigned URL expired"
               if where.startswith(("http://", "https://")) else
               "check the credentials the standard chain finds (AWS_ACCESS_KEY_ID / AWS_PROFILE, ~/.aws, the "
               "instance role) and the bucket's policy")
        return ObjectAccessDenied(f"{doing} {where} failed: {what}: access denied ({reason}); {fix}", url=where,
                                  status=status)
    after = f" after {tries} tries" if tries > 1 else ""
    return ObjectStoreError(f"{doing} {where} failed{after}: {what} ({reason}); the store is failing, throttling or "
                            "unreachable: try again later, or read with fewer processes", url=where, status=status)


def remote_call(url: str, doing: str, fn: Callable[[], T], policy: RetryPolicy | None = None) -> T:
    """``fn()``, tried again after transient failures as ``policy`` says (None: RETRY as it is at
    the call).

    Raised when it fails for good: ``remote_error``'s class (ObjectNotFound, ObjectAccessDenied,
    SourceChanged, ObjectStoreError)."""
    policy = RETRY if policy is None else policy
    start = time.monotonic()
    attempt = 0
    while True:
        try:
            return fn()
        except H5ServeError:
            raise
        except Exception as exc:
            attempt += 1
            chain = _chain(exc)
            status, code = _status(chain)
            wait = policy.wait(attempt - 1)
            if (not _is_transient(chain, status, code) or attempt >= policy.attempts
                    or time.monotonic() - start + wait > policy.deadline_s):
                if shown_url(url) != url:  # the libraries' own messages would show its query string (a signature)
                    raise remote_error(exc, url, doing, attempt) from None
                raise remote_error(exc, url, doing, attempt) from exc
            log.debug("h5serve: %s %s: %s (try %d of %d); again in %.2f s", doing, shown_url(url),
                      status or type(exc).__name__, attempt, policy.attempts, wait)
            time.sleep(wait)


def remote_identity(url: str, doing: str = "looking up") -> RemoteIdentity:
    """The identity of the object ``url`` names now (one HEAD request on S3); ``doing``: what
    an error says was being done.

    Raised as ``remote_call`` is; for a bad URL or a missing backend: ConfigError."""
    scheme, path = parse_url(url)
    fs = _filesystem(scheme)
    info = remote_call(url, doing, lambda: fs.info(path, refresh=True) if scheme == "s3" else fs.info(path))
    if info.get("type", "file") != "file":
        raise ObjectNotFound(f"{shown_url(url)} is a directory (a prefix), not an object: name an HDF5 file",
                             url=shown_url(url), status=None)
    return RemoteIdentity.of(url, info)


def expand_url_pattern(pattern: str) -> list[str]:
    """The objects a URL with ``*``, ``?`` or ``[...]`` names (fsspec's glob), sorted, as URLs.

    Raised as ``remote_call`` is."""
    scheme, path = parse_url(pattern)
    fs = _filesystem(scheme)
    found = remote_call(pattern, "listing", lambda: fs.glob(path))
    prefix = "" if scheme in ("http", "https") else f"{scheme}://"
    return sorted(prefix + str(p) for p in found)


async def s3_get_range(fs: Any, bucket: str, key: str, start: int, end: int, etag: str, version_id: str) -> bytes:
    """Bytes ``[start, end)`` of an S3 object in one ranged GET through s3fs's client (``fs``:
    an s3fs filesystem), with ``If-Match: etag`` and ``VersionId`` when given: a rewritten object
    fails the request (412) instead of mixing two versions."""
    kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key, "Range": f"bytes={start}-{end - 1}"}
    if etag:
        kwargs["IfMatch"] = etag
    if version_id:
        kwargs["VersionId"] = version_id
    response = await fs._call_s3("get_object", **kwargs)
    body = response["Body"]
    try:
        return bytes(await body.read())
    finally:
        body.close()


class RemoteFile(io.RawIOBase):
    """A remote file opened read-only for h5py (``h5py.File(RemoteFile)``), with a cache of
    ``cache_blocks`` blocks of ``block_bytes`` (the least recently used dropped). A read's
    missing blocks are requested together (FETCH_AT_ONCE in flight at most) by the reading
    thread itself (threadloop.py: why never by a service thread), each pinned to the version
    opened (S3: ``If-Match: <ETag>``), through ``remote_call`` (retries, h5serve's errors)."""

    def __init__(self, url: str, identity: RemoteIdentity, block_bytes: int, cache_blocks: int) -> None:
        super().__init__()
        self.url = url
        self.identity = identity
        self.scheme, self._path = parse_url(url)
        self.block_bytes, self.cache_blocks = max(1, block_bytes), max(1, cache_blocks)
        self._options = _options(self.scheme)
        # an https server's ETag, when strong, sent as If-Match (a weak one never matches: RFC 9110)
        etag = identity.etag
        self._pinned: dict[str, Any] = ({"headers": {"If-Match": etag}} if self.scheme in ("http", "https")
                                        and etag and not etag.startswith("W/") else {})
        self._blocks: OrderedDict[int, bytes] = OrderedDict()
        self._pos = 0
        self._fetched = 0

    def readable(self) -> bool:
        return True

    @property
    def fetched_bytes(self) -> int:
        """Bytes this file has fetched from the store so far."""
        return self._fetched

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.identity.size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self.identity.size - self._pos))
        if n == 0:
            return 0
        size, at = self.block_bytes, self._pos
        wanted = range(at // size, (at + n - 1) // size + 1)
        blocks = {b: self._blocks.get(b) for b in wanted}
        missing = [b for b, data in blocks.items() if data is None]
        if missing:
            got = remote_call(self.url, "reading", lambda: run_here(self._fetch(missing)))
            blocks.update(zip(missing, got))
        done = 0
        for b in wanted:
            data = blocks[b]
            assert data is not None
            lo, hi = max(at, b * size) - b * size, min(at + n, (b + 1) * size) - b * size
            view[done:done + hi - lo] = data[lo:hi]
            done += hi - lo
            self._blocks[b] = data
            self._blocks.move_to_end(b)
        while len(self._blocks) > self.cache_blocks:
            self._blocks.popitem(last=False)
        self._pos = at + n
        return n

    async def _fetch(self, blocks: list[int]) -> list[bytes]:
        """The bytes of ``blocks``, FETCH_AT_ONCE requests in flight at most; after a failure the
        others are cancelled (none is left running in the loop for the next read)."""
        try:
            fs = _one_try(self.scheme, filesystem_here(self.scheme, self._options))
        except ImportError as exc:
            raise _missing_backend(self.scheme, exc) from exc
        gate = asyncio.Semaphore(FETCH_AT_ONCE)

        async def one(block: int) -> bytes:
            start = block * self.block_bytes
            end = min(start + self.block_bytes, self.identity.size)
            async with gate:
                if self.scheme == "s3":
                    bucket, key, version = fs.split_path(self._path)
                    data = await s3_get_range(fs, bucket, key, start, end, self.identity.etag, version or "")
                else:
                    data = await fs._cat_file(self._path, start=start, end=end, **self._pinned)
            self._fetched += len(data)
            if len(data) == self.identity.size and len(data) != end - start:  # a server that ignored the Range
                data = data[start:end]
            if len(data) != end - start:  # counted as a connection cut short: tried again
                raise ConnectionError(f"bytes {start}-{end - 1} came back as {len(data)} bytes")
            return bytes(data)

        tasks = [asyncio.ensure_future(one(b)) for b in blocks]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    def close(self) -> None:
        self._blocks.clear()
        super().close()


def open_remote(url: str, pin: RemoteIdentity | None = None, *, block_bytes: int | None = None,
                cache_blocks: int | None = None) -> RemoteFile:
    """``url`` opened for reading (one HEAD request, no data yet), with a block cache of
    ``cache_blocks`` blocks of ``block_bytes`` (None: CACHE_BLOCKS, BLOCK_BYTES as they are at
    the call); ``pin``: the identity it must still have.

    Raised when it is not ``pin`` any more: SourceChanged naming both. Raised as
    ``remote_call`` is; for a bad URL or a missing backend: ConfigError."""
    identity = remote_identity(url, "opening")
    if pin is not None and (identity.size, identity.etag, identity.version_id) != (
            pin.size, pin.etag, pin.version_id):
        raise SourceChanged(f"{shown_url(url)} changed since this job described it ({pin.describe()}; now "
                            f"{identity.describe()}): restart the job to read the new object, and write new "
                            "data under new keys rather than over objects a job reads")
    return RemoteFile(url, identity, BLOCK_BYTES if block_bytes is None else block_bytes,
                      CACHE_BLOCKS if cache_blocks is None else cache_blocks)

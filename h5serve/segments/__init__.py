"""Shared-memory segments, the meeting point of daemon and clients: the on-disk format
(format.py: header, ``SegmentMeta``, reading meta and progress), names and ownership
(naming.py: keyed by the daemon's secret), the content checksum (checksum.py: computing it,
``verify_content``), the file's lifecycle (lifecycle.py: create, publish, check, evict),
mapping one (attach.py: by name or from a descriptor, with a lease) and asking the daemon for
a descriptor (handout.py).

``from h5serve.segments import X`` is the way in; the header layout names stay in format.py.

May import: h5serve.wire (the runtime dir's descriptor socket), h5serve.order, h5serve.util, h5serve.errors
"""

from .attach import LEASE_WAIT_S, UNKNOWN_STAMP, AttachedSegment, PublishStamp, attach_descriptor, attach_segment
from .checksum import data_checksum, header_checksum, verify_content
from .format import (
    HEADER_SIZE,
    MAX_HEADER_BYTES,
    SegmentMeta,
    read_activity,
    read_meta,
    read_progress,
    values_offset,
    vlen_nbytes,
)
from .handout import open_segment, request_descriptor
from .lifecycle import (
    PUBLISHED_MODE,
    SegmentWriter,
    any_leased,
    check_published,
    count_leases,
    create_segment,
    open_published,
    try_evict,
)
from .naming import (
    SECRET_BYTES,
    fresh_name,
    is_published_as,
    segment_name,
    segment_prefix,
    temporary_name,
    temporary_owner_pid,
)

__all__ = [
    "HEADER_SIZE",
    "MAX_HEADER_BYTES",
    "SECRET_BYTES",
    "LEASE_WAIT_S",
    "SegmentMeta",
    "SegmentWriter",
    "AttachedSegment",
    "segment_prefix",
    "segment_name",
    "temporary_name",
    "temporary_owner_pid",
    "fresh_name",
    "is_published_as",
    "create_segment",
    "PUBLISHED_MODE",
    "PublishStamp",
    "UNKNOWN_STAMP",
    "check_published",
    "open_published",
    "attach_segment",
    "attach_descriptor",
    "open_segment",
    "request_descriptor",
    "read_progress",
    "read_meta",
    "read_activity",
    "header_checksum",
    "verify_content",
    "data_checksum",
    "try_evict",
    "count_leases",
    "any_leased",
    "values_offset",
    "vlen_nbytes",
]

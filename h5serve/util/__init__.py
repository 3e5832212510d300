"""Small helpers every part shares, each the one definition of its kind: sizes in bytes
(units.py), the integer check (checks.py), content checksums (crc.py), opening what other users
may have planted (safeio.py), load progress on a terminal or a log (progress.py), user text in
log lines (logtext.py), a bounded least-recently-used cache (lru.py). Import the module:
``from h5serve.util.units import parse_size``.

May import: h5serve.errors
"""

__all__: list[str] = []

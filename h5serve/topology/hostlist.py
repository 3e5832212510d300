"""SLURM's compact notations: hostlists (``node[01-03,7]``), task layouts (``3(x2),2,1``)
and rank lists (``0-3,5``). Pure functions; every error is a ConfigError that says what to do.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from itertools import product

from ..errors import ConfigError
from ..wire.protocol import MAX_WORLD_SIZE

__all__ = ["MAX_HOSTS", "expand_nodelist", "expand_tasks_per_node", "format_ranks", "parse_tasks_per_node"]

MAX_HOSTS = 1 << 20  # a hostlist that expands to more names than this is refused (no giant lists)
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


# --------------------------------------------------------------------------- hostlists


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets. Raised when brackets do not pair up: ConfigError."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ConfigError(f"node list {text!r}: nested '[' at position {i}; brackets cannot nest")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"node list {text!r}: ']' at position {i} has no matching '['")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"node list {text!r}: a '[' is never closed; add the missing ']'")
    parts.append(text[start:])
    return parts


def _expand_brackets(group: str, entry: str) -> list[str]:
    """'01-03,7' -> ['01', '02', '03', '7']: a range keeps the width of its lower bound."""
    values: list[str] = []
    for item in group.split(","):
        item = item.strip()
        match = _RANGE.match(item)
        if not match:
            raise ConfigError(
                f"node list entry {entry!r}: [{group}] must hold numbers or ranges like 01-03,7 (got {item!r})"
            )
        lo_text, hi_text = match.group(1), match.group(2)
        if hi_text is None:
            values.append(lo_text)
            continue
        lo, hi = int(lo_text), int(hi_text)
        if lo > hi:
            raise ConfigError(f"node list entry {entry!r}: range {item} runs backwards; write {hi_text}-{lo_text}")
        if hi - lo + 1 > MAX_HOSTS:
            raise ConfigError(f"node list entry {entry!r}: range {item} has more than {MAX_HOSTS} names")
        width = len(lo_text)
        values.extend(f"{n:0{width}d}" for n in range(lo, hi + 1))
    return values


def _expand_entry(entry: str) -> list[str]:
    pieces: list[list[str]] = []  # literal text as one-element lists, bracket groups expanded
    pos = 0
    for match in re.finditer(r"\[([^\[\]]*)\]", entry):
        if match.start() > pos:
            pieces.append([entry[pos:match.start()]])
        pieces.append(_expand_brackets(match.group(1), entry))
        pos = match.end()
    if pos < len(entry):
        pieces.append([entry[pos:]])
    count = 1
    for piece in pieces:
        count *= len(piece)
    if count > MAX_HOSTS:
        raise ConfigError(f"node list entry {entry!r} expands to {count} names, more than {MAX_HOSTS}")
    return ["".join(combo) for combo in product(*pieces)]


def expand_nodelist(text: str) -> list[str]:
    """Expand a SLURM hostlist, as ``scontrol show hostnames`` does, in order.

    ``"node[01-03,7],gpu-a[1-2]x,login1"`` ->
    ``["node01", "node02", "node03", "node7", "gpu-a1x", "gpu-a2x", "login1"]``.

    - Entries are separated by commas at the top level; commas inside ``[...]`` separate the
      numbers and ranges of that bracket.
    - A range ``lo-hi`` keeps the width of ``lo``: ``[08-10]`` is ``08 09 10``, ``[8-10]`` is
      ``8 9 10``; a single number is kept as written.
    - Several bracket groups in one name expand to every combination, the last group varying
      fastest: ``r[1-2]n[1-2]`` is ``r1n1 r1n2 r2n1 r2n2``.
    - Whitespace around entries is ignored.

    Raised when the text is empty, has an empty entry, unbalanced or nested brackets, a
    bracket that is not numbers and ranges, a backwards range, whitespace inside a name, or
    expands to more than ``MAX_HOSTS`` names: ConfigError.
    """
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"node list {text!r} is empty; expected a SLURM hostlist like node[01-04]")
    hosts: list[str] = []
    for raw in _split_top_level(text.strip()):
        entry = raw.strip()
        if not entry:
            raise ConfigError(f"node list {text!r} has an empty entry; remove the stray comma")
        if any(ch.isspace() for ch in entry):
            raise ConfigError(f"node list entry {entry!r} contains whitespace; host names cannot")
        hosts.extend(_expand_entry(entry))
        if len(hosts) > MAX_HOSTS:
            raise ConfigError(f"node list {text[:80]!r} expands to more than {MAX_HOSTS} names")
    return hosts


# --------------------------------------------------------------------------- task layouts


def parse_tasks_per_node(text: str) -> list[int]:
    """Expand SLURM's compressed tasks-per-node list: ``"3(x2),2,1"`` -> ``[3, 3, 2, 1]``.

    Raised when an entry is not ``N`` or ``N(xK)`` with K >= 1, or the list describes more
    than ``MAX_HOSTS`` nodes or more than ``MAX_WORLD_SIZE`` tasks: ConfigError.
    """
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"tasks per node {text!r} is empty; expected e.g. 4 or 4(x2) or 3(x2),2,1")
    entries: list[tuple[int, int]] = []
    nodes = tasks = 0
    for raw in text.split(","):
        match = _TASKS.match(raw.strip())
        if not match:
            raise ConfigError(
                f"tasks per node {text!r}: {raw.strip()!r} is not N or N(xK); expected e.g. 3(x2),2,1"
            )
        value, repeat = int(match.group(1)), int(match.group(2) or 1)
        if repeat < 1:
            raise ConfigError(f"tasks per node {text!r}: repeat count in {raw.strip()!r} must be at least 1")
        nodes += repeat
        tasks += value * repeat
        if nodes > MAX_HOSTS or tasks > MAX_WORLD_SIZE:
            raise ConfigError(
                f"tasks per node {text[:80]!r} describes more than {MAX_HOSTS} nodes or {MAX_WORLD_SIZE} tasks"
            )
        entries.append((value, repeat))
    return [value for value, repeat in entries for _ in range(repeat)]


def expand_tasks_per_node(text: str, nodes: int) -> list[int]:
    """Expand ``SLURM_TASKS_PER_NODE``-style text and check it covers exactly ``nodes`` nodes.

    ``expand_tasks_per_node("3(x2),2,1", 4)`` -> ``[3, 3, 2, 1]``.

    Raised when the text is malformed (see ``parse_tasks_per_node``) or does not describe
    exactly ``nodes`` nodes: ConfigError.
    """
    tasks = parse_tasks_per_node(text)
    if len(tasks) != nodes:
        raise ConfigError(
            f"tasks per node {text!r} describes {len(tasks)} node(s) but the node list has {nodes}; "
            "take both from the same job or step (SLURM_TASKS_PER_NODE with SLURM_JOB_NODELIST)"
        )
    return tasks


def format_ranks(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 3, 5]`` -> ``"0-3,5"`` (the syntax ``h5serve preload --ranks`` takes); ``"none"``
    for no ranks."""
    if not ranks:
        return "none"
    spans: list[str] = []
    ordered = sorted(ranks)
    start = prev = ordered[0]
    for rank in [*ordered[1:], None]:
        if rank is not None and rank == prev + 1:
            prev = rank
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        if rank is not None:
            start = prev = rank
    return ",".join(spans)


# --------------------------------------------------------------------------- plans

"""The layout torchrun describes in its workers' environment. Pure: the environment is an
argument.

torchrun runs ``LOCAL_WORLD_SIZE`` workers on every node and numbers them
``GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK`` (static and c10d rendezvous alike), so the
layout is uniform: ``WORLD_SIZE / LOCAL_WORLD_SIZE`` nodes of consecutive ranks.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import ConfigError
from .layout import NodeLayout, uniform_layout

__all__ = ["TORCHRUN_VARIABLES", "layout_from_torchrun_env", "torchrun_rank_world"]

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
_MARKERS = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")  # set by launchers, not by hand-made RANK/WORLD_SIZE
_HINT = "launch with torchrun, or pass local_world_size/node_rank to say which ranks share a node"


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "").strip()
    if value == "":
        return None
    if not value.isdigit():
        raise ConfigError(f"environment variable {name}={value!r} is not a non-negative integer; {_HINT}")
    return int(value)


def torchrun_rank_world(env: Mapping[str, str]) -> tuple[int, int] | None:
    """``(RANK, WORLD_SIZE)`` when both are set, else None.

    Raised when either is not a non-negative integer, or ``RANK`` is not below
    ``WORLD_SIZE``: ConfigError.
    """
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if rank is None or world is None:
        return None
    if world < 1 or rank >= world:
        raise ConfigError(f"RANK={rank} must be below WORLD_SIZE={world} (and WORLD_SIZE at least 1); {_HINT}")
    return rank, world


def layout_from_torchrun_env(env: Mapping[str, str]) -> NodeLayout | None:
    """The layout from ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and
    (checked when set) ``GROUP_RANK`` and ``GROUP_WORLD_SIZE``; None when none of
    ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``/``GROUP_RANK`` is set (no launcher).

    Raised when some of the four are missing, are not integers, or disagree:
    ``LOCAL_RANK >= LOCAL_WORLD_SIZE``, ``WORLD_SIZE`` not a multiple of ``LOCAL_WORLD_SIZE``,
    ``RANK`` not ``GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK``: ConfigError naming them.
    """
    if all(env.get(name, "").strip() == "" for name in _MARKERS):
        return None
    values = {name: _int(env, name) for name in (*TORCHRUN_VARIABLES, "GROUP_WORLD_SIZE")}
    missing = [name for name in TORCHRUN_VARIABLES[:4] if values[name] is None]
    if missing:
        present = [name for name in _MARKERS if values[name] is not None]
        raise ConfigError(
            f"{', '.join(present)} set but {', '.join(missing)} not: torchrun sets all of "
            f"{', '.join(TORCHRUN_VARIABLES[:4])}; {_HINT}"
        )
    rank, world, local, local_world = (values[name] for name in TORCHRUN_VARIABLES[:4])
    assert rank is not None and world is not None and local is not None and local_world is not None
    if world < 1 or local_world < 1 or rank >= world:
        raise ConfigError(
            f"RANK={rank}, WORLD_SIZE={world}, LOCAL_WORLD_SIZE={local_world}: need RANK < WORLD_SIZE and both "
            f"sizes at least 1; {_HINT}"
        )
    if local >= local_world:
        raise ConfigError(f"LOCAL_RANK={local} is not below LOCAL_WORLD_SIZE={local_world}; {_HINT}")
    if world % local_world:
        raise ConfigError(
            f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local_world}, but torchrun runs the same "
            f"number of ranks on every node; {_HINT}"
        )
    if rank % local_world != local:
        raise ConfigError(
            f"RANK={rank} with LOCAL_WORLD_SIZE={local_world} is local rank {rank % local_world}, but "
            f"LOCAL_RANK={local}; {_HINT}"
        )
    layout = uniform_layout(rank, world, local_world, "torchrun")
    group, groups = values["GROUP_RANK"], values["GROUP_WORLD_SIZE"]
    if group is not None and group != layout.node_rank:
        raise ConfigError(
            f"GROUP_RANK={group} disagrees with RANK={rank}, LOCAL_WORLD_SIZE={local_world} (node "
            f"{layout.node_rank}); {_HINT}"
        )
    if groups is not None and groups != layout.num_nodes:
        raise ConfigError(
            f"GROUP_WORLD_SIZE={groups} disagrees with WORLD_SIZE={world} / LOCAL_WORLD_SIZE={local_world} "
            f"({layout.num_nodes} nodes); {_HINT}"
        )
    return layout

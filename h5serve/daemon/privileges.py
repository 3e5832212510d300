"""Running the daemon as another user: look-ups and the privilege drop.

A root-started daemon (the SLURM prolog case) must become the job user before it creates
the runtime dir, the socket or any segment, so everything it makes belongs to that user.
"""

from __future__ import annotations

import grp
import os
import pwd
from dataclasses import dataclass

from ..errors import ConfigError

__all__ = ["Account", "lookup_user", "lookup_group", "drop_privileges"]


@dataclass(frozen=True)
class Account:
    name: str
    uid: int
    gid: int
    home: str


def lookup_user(user: str) -> Account:
    """A user by name or numeric uid. Raised when there is no such user: ConfigError."""
    try:
        pw = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"--user {user!r}: no such user on this machine") from exc
    return Account(pw.pw_name, pw.pw_uid, pw.pw_gid, pw.pw_dir)


def lookup_group(group: str) -> int:
    """A gid by group name or number. Raised when there is no such group: ConfigError."""
    try:
        return int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"--group {group!r}: no such group on this machine") from exc


def drop_privileges(account: Account) -> None:
    """Become ``account`` for good (groups, gid, then uid). A no-op if we already are.

    Raised when we are not root and not already that user: ConfigError.
    """
    if os.getuid() == account.uid and os.geteuid() == account.uid:
        return
    if os.geteuid() != 0:
        raise ConfigError(f"--user {account.name} needs the daemon to be started as root")
    os.initgroups(account.name, account.gid)
    os.setgid(account.gid)
    os.setuid(account.uid)
    os.environ.update({"HOME": account.home, "USER": account.name, "LOGNAME": account.name})

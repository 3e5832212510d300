"""Running the daemon as another user: look-ups and the privilege drop.

A root-started daemon (the SLURM prolog case) must become the job user before it opens or
creates anything in the runtime dir, so everything it makes belongs to that user and root
never acts on a path the user controls. Root does exactly one thing first: make sure the
runtime dir exists and is the user's (``prepare_runtime_dir``), by descriptor, never by path.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
from dataclasses import dataclass

from ...errors import ConfigError
from ...util.safeio import describe_owner
from ...wire.runtime import RuntimeLocation

__all__ = ["Account", "lookup_user", "lookup_group", "drop_privileges", "prepare_runtime_dir"]


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
    from ..server import raise_open_file_limit  # lazy: zmq is not needed to drop privileges

    raise_open_file_limit()  # while root may still raise the hard limit: the user's daemon keeps it
    os.initgroups(account.name, account.gid)
    os.setgid(account.gid)
    os.setuid(account.uid)
    os.environ.update({"HOME": account.home, "USER": account.name, "LOGNAME": account.name})


def prepare_runtime_dir(location: RuntimeLocation, account: Account) -> None:
    """As root, before dropping to ``account``: make sure the runtime dir exists and belongs to
    it, so that the user (who may not create entries in its parent, e.g. /run/h5serve) can
    use it. Works through descriptors only: the dir is created with ``mkdirat`` in its
    parent, opened with ``O_NOFOLLOW`` and handed over with ``fchown`` only when this call
    created it (an empty root-owned dir); an existing dir must already be the user's. Root
    never looks inside it.

    Raised when it is a symlink or not a directory, or an existing dir belongs to someone
    else: ConfigError.
    """
    directory = location.directory
    hint = "remove it or choose another --runtime-dir"
    directory.parent.mkdir(mode=0o755, parents=True, exist_ok=True)  # root's own path, e.g. /run/h5serve
    parent = os.open(directory.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            os.mkdir(directory.name, 0o700, dir_fd=parent)
            created = True
        except FileExistsError:
            created = False
        try:
            fd = os.open(directory.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise ConfigError(f"runtime dir {directory} is a symbolic link or not a directory; {hint}") from exc
            raise ConfigError(f"cannot open runtime dir {directory}: {exc.strerror}") from exc
        try:
            st = os.fstat(fd)
            if st.st_uid == account.uid:
                return  # the user's own: the daemon, as the user, checks the rest
            if created and st.st_uid == os.geteuid() and not os.listdir(fd):
                os.fchown(fd, account.uid, account.gid)
                os.fchmod(fd, 0o700)
                return
            raise ConfigError(
                f"runtime dir {directory} belongs to {describe_owner(st.st_uid)}, not to {account.name}; {hint}"
            )
        finally:
            os.close(fd)
    finally:
        os.close(parent)

"""Pid 1 of one test node (tests/cluster): started by ``unshare --mount --uts --ipc --pid --fork
--mount-proc`` inside the node's network namespace, it makes the node's file system, says
``ready`` on stdout, then reaps every orphan (daemons double-fork to it) until its stdin closes or
it gets SIGTERM. When it exits the kernel SIGKILLs every process of the node's pid namespace, and
the node's mount namespace (its tmpfs mounts with all they hold) goes with the last of them.

Standard library only, run as a script (``python _init.py CONFIG_JSON``): it must not import the
project it shares with the nodes.

The mounts, in order (each a reason in docs/testing.md):
- /etc/hosts: the cluster's hosts file, so every node resolves every node's name to its address
  (torchrun's c10d rendezvous and gloo resolve host names);
- /run, /tmp: fresh tmpfs (a daemon's runtime dir, a job's temporary files are the node's own),
  then every shared path that lived under them bound back at the same path, from a descriptor of
  the directory opened before it was covered;
- /dev/shm: a tmpfs of the asked size, the node's own shared memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import select
import signal
import socket
import sys

MS_NOSUID, MS_NODEV, MS_BIND, MS_REC = 0x2, 0x4, 0x1000, 0x4000
HIDDEN = ("/run", "/tmp")  # covered by the node's tmpfs: shared paths under them are bound back

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    if _libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                   data.encode() if data else None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def tmpfs(target: str, options: str) -> None:
    mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, options)


def bind_back(path: str, under: str, fd: int) -> None:
    """Bind ``path`` (under ``under``, now covered) from the covered tree, reached through ``fd``."""
    source = f"/proc/self/fd/{fd}/{os.path.relpath(path, under)}"
    if os.path.isdir(source):
        os.makedirs(path, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "a").close()
    mount(source, path, None, MS_BIND | MS_REC)


def make_filesystem(config: dict) -> None:
    mount(config["hosts"], "/etc/hosts", None, MS_BIND)
    covered = {under: os.open(under, os.O_PATH | os.O_DIRECTORY) for under in HIDDEN}
    tmpfs("/run", "mode=755")
    tmpfs("/tmp", "mode=1777")
    for path in sorted(config["share"]):  # parents before children
        for under in HIDDEN:
            if path.startswith(under + "/"):
                bind_back(path, under, covered[under])
    for fd in covered.values():
        os.close(fd)
    tmpfs("/dev/shm", f"mode=1777,size={config['shm']}")
    socket.sethostname(config["hostname"])


def serve() -> None:
    """Reap children until stdin closes or SIGTERM: pid 1 of a namespace gets no default
    signal actions, so SIGTERM is handled here."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    while True:
        readable, _, _ = select.select([0, wake_r], [], [])
        if 0 in readable and not os.read(0, 4096):
            os._exit(0)
        if wake_r in readable:
            os.read(wake_r, 4096)
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break


def main() -> None:
    config = json.loads(sys.argv[1])
    try:
        make_filesystem(config)
    except OSError as exc:
        print(f"failed: {exc}", flush=True)
        os._exit(1)
    print("ready", flush=True)
    serve()


if __name__ == "__main__":
    main()

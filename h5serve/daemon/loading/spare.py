"""A loader process started ahead of need, so that a load starts the moment it is asked for.

Starting a loader through the forkserver (the daemon pickles the job, the forkserver forks,
the child unpickles it) took 5-8 ms between the daemon deciding to load and the loader's
first line, on every load; the first load after the daemon started also waited for the
forkserver to finish importing numpy and h5py (0.2-0.4 s). The store keeps one spare
started while no load runs: it waits for a LoadJob on a pipe, then runs it as any loader
does (loader.run_load) and is used up. A spare dies with the daemon like a loader (it arms
PR_SET_PDEATHSIG and its pidfd watch before waiting; its job pipe reads EOF when the daemon
is gone), and the store kills it on shutdown. It shows as ``h5serve-spare`` until it takes
its job, then as ``h5serve-load``. A spare that takes a stream block's job stays for the next
blocks (streamloader.py, loaderpool.py).

While it waits, a spare takes its own copies of the pages it shares copy-on-write with the
forkserver (``_process.unshare_inherited_pages``, ~23 MB), a MiB at a time and stopping as soon
as a job comes: a load's first writes then copy nothing, and so interrupt nothing (a copy in a
process whose reservation thread runs on the other core flushes that core's TLB). 1-process
loads of 307 MB on the bench's VM: 134 ms from request to ready against 140 ms (median of 10
alternating rounds); loads split across processes are unchanged (their children are forked
after the job comes, and share pages again).
"""

from __future__ import annotations

import multiprocessing
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection

from .._process import SPARE_NAME, set_process_name, unshare_inherited_pages
from .loader import LoadJob, die_with_daemon, run_load
from .streamloader import serve_jobs

__all__ = ["Spare", "start_spare"]


@dataclass(frozen=True)
class Spare:
    """A waiting loader: ``jobs`` takes its one LoadJob, ``reply`` then carries its result."""

    process: multiprocessing.context.ForkServerProcess
    jobs: Connection
    reply: Connection

    def take(self, job: LoadJob) -> bool:
        """Hand ``job`` over; False (the spare cleaned up) when the spare is gone. The job pipe
        stays open for a job to keep the loader for (``job.keep``: loaderpool.py)."""
        try:
            if self.process.is_alive():
                self.jobs.send(job)
                if not job.keep:
                    self.jobs.close()
                return True
        except OSError:
            pass
        self.discard()
        return False

    def discard(self) -> None:
        """Let the spare go (its job pipe reads EOF and it exits) and reap it."""
        for end in (self.jobs, self.reply):
            if not end.closed:
                end.close()
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)


def _wait_for_job(jobs: Connection, reply: Connection, daemon_pid: int) -> None:
    daemon_gone = die_with_daemon(daemon_pid)
    set_process_name(SPARE_NAME)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when loads stop
    try:
        unshare_inherited_pages(stop=lambda: jobs.poll(0))
        job = jobs.recv()
    except (EOFError, OSError):  # the daemon is gone, or let this spare go
        reply.close()
        jobs.close()
        return
    if job.keep:  # a stream block: the loader stays for the next ones
        serve_jobs(job, jobs, reply, daemon_gone)
        return
    jobs.close()
    run_load(job, reply, daemon_gone)


def start_spare(ctx: multiprocessing.context.ForkServerContext, daemon_pid: int) -> Spare:
    """Start a spare loader (blocks until the forkserver has forked it)."""
    jobs_in, jobs = ctx.Pipe(duplex=False)
    reply, reply_out = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_wait_for_job, args=(jobs_in, reply_out, daemon_pid), name="h5serve-load-spare",
                          daemon=True)
    process.start()
    jobs_in.close()
    reply_out.close()
    return Spare(process, jobs, reply)

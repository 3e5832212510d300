"""The daemon reaps a loader's report even when the loader reports and exits in the instant
between the store's two looks at it (its pipe, then whether it is alive).

The CI rehearsal hit that race once on a busy 2-core machine: the store saw an empty pipe, the
loader then sent its reply and exited, and the store saw it dead and failed the load with
"the loader process died (exit code 0)". Here the race is made certain: the loader's pipe,
the first time the store polls it, lets the loader report and exit before answering.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from multiprocessing.connection import Connection

import pytest

from h5serve.daemon.loading.loader import LoadError
from h5serve.daemon.store.entries import Entry
from h5serve.daemon.store.store import SegmentStore
from h5serve.wire.runtime import RuntimeLocation

from ..helpers import make_meta, short_workdir

pytestmark = pytest.mark.timeout(60)


def _report_when_told(go: Connection, reply: Connection) -> None:
    go.recv()
    reply.send(LoadError("DataError", "the rows could not be read"))


class _PipeSeenBeforeTheReport:
    """The store's end of a loader's pipe that, on its first poll, finds it empty and only
    then lets the loader report and exit: the daemon descheduled between its two looks."""

    def __init__(self, reply: Connection, go: Connection, loader: multiprocessing.process.BaseProcess) -> None:
        self._reply, self._go, self._loader = reply, go, loader
        self.polls = 0

    def poll(self, timeout: float = 0.0) -> bool:
        self.polls += 1
        ready = self._reply.poll(timeout)
        if self.polls == 1:
            self._go.send(None)
            self._loader.join(10)
        return ready

    def __getattr__(self, name: str) -> object:
        return getattr(self._reply, name)


@pytest.fixture
def store() -> Iterator[SegmentStore]:
    with short_workdir("h5s-reap-") as tmp:
        shm = tmp / "shm"
        shm.mkdir()
        yield SegmentStore(RuntimeLocation(tmp / "rt"), shm, 1 << 30, loaders=1)


def test_a_loader_that_reports_and_exits_between_the_stores_looks_is_heard(store: SegmentStore) -> None:
    ctx = multiprocessing.get_context("fork")
    reply, reply_out = ctx.Pipe(duplex=False)
    go_in, go = ctx.Pipe(duplex=False)
    loader = ctx.Process(target=_report_when_told, args=(go_in, reply_out), daemon=True)
    loader.start()
    reply_out.close()
    go_in.close()
    try:
        entry = Entry("seg", make_meta(), "loading", tmp_name="seg.tmp")
        pipe = _PipeSeenBeforeTheReport(reply, go, loader)
        entry.process, entry.reply = loader, pipe  # type: ignore[assignment]
        store.entries["seg"] = entry
        store.loads.start(entry)  # as _launch_pending does when a loader starts
        for _ in range(3):  # the report is picked up on a later round at the latest
            store.poll_loads()
            if "seg" not in store.entries:
                break
        assert pipe.polls >= 1
        failure = store.failures["seg"]
        assert (failure.code, failure.message) == ("DataError", "the rows could not be read")  # not "died"
    finally:
        try:  # the store closes the process object once it reaped it
            if loader.is_alive():
                loader.kill()
            loader.join(10)
        except ValueError:
            pass
        go.close()

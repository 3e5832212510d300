"""client/streaming/automatic.py's agreement: in a process group every rank takes the same decision and
window, stream if any rank was refused, with the smallest budget and limit any rank knows
(2 real gloo processes)."""

from __future__ import annotations

import multiprocessing as mp
import queue
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

# rank -> (wants, budget, limit) as each rank found them: rank 1 had no daemon answer
ASKED = {0: (True, 8 << 20, 6 << 20), 1: (False, None, None)}


def _rank(rank: int, store: str, out: mp.Queue) -> None:
    import datetime

    import torch.distributed as dist

    from h5serve.client.streaming.automatic import _agree

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        out.put((rank, _agree(*ASKED[rank], 2)))
    finally:
        dist.destroy_process_group()


def test_ranks_agree_on_stream_and_the_smallest_limit(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "store"), out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=90) for _ in procs)
    except queue.Empty:
        pytest.fail("a rank did not answer: the all-reduce hung")
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert got[0] == got[1] == (True, 8 << 20, 6 << 20)


def test_without_a_process_group_each_rank_keeps_its_own() -> None:
    from h5serve.client.streaming.automatic import _agree

    assert _agree(False, None, None, 2) == (False, None, None)
    assert _agree(True, 5, 4, 1) == (True, 5, 4)

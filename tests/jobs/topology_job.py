"""Run under torchrun (gloo, CPU) by tests/integration/test_topology.py: resolves this rank's NodeLayout
through the real process group and writes ``<out>/rank<N>.json``."""

import json
import os
import sys

import torch.distributed as dist

from h5serve.topology import resolve_layout


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report = {
        # the default: os.environ, this host, the initialized group (cross-checked with torchrun's variables)
        "default": resolve_layout().to_dict(),
        # no variables at all: only the process group's all-gather can know the layout
        "group_only": resolve_layout(env={}).to_dict(),
        # each rank claims its own host: the all-gather must carry rank 1's name to rank 0 and back
        "two_hosts": resolve_layout(env={}, hostname=f"host{rank}").to_dict(),
        # torchrun's variables alone, for comparison
        "torchrun_env": resolve_layout(env=dict(os.environ), group=None).to_dict(),
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

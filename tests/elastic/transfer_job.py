"""An elastic job for the tests whose workers all-gather a large tensor every step, over Gloo's own
point-to-point messages (``transport="gloo"``), under ``px.elastic.run``.

``--die-rank R`` makes member R post its second gather and stop (SIGSTOP) with the gather's
megabytes on their way: its peers' sends to it fill the connections and wait, part-way through, until
a child of its own kills it (SIGKILL) ``--die-after`` seconds later. Gloo does not end such a send when
the connection closes. Rank 0 writes the steps, the job's final size and its recoveries to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

import torch

torch.set_num_threads(1)

STEPS = 4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--pids", required=True)
    parser.add_argument("--progress", required=True)
    parser.add_argument("--megabytes", type=int, default=16, help="each worker's part of a gather (more than "
                        "a connection holds)")
    parser.add_argument("--die-rank", type=int, default=-1)
    parser.add_argument("--die-after", type=float, default=1.0)
    args = parser.parse_args()
    member = int(os.environ["PHALANX_RANK"])
    with open(os.path.join(args.pids, f"{member}.pid"), "w") as handle:
        handle.write(str(os.getpid()))

    import phalanx as px
    from phalanx import elastic

    px.init(transport="gloo")
    part = torch.full((args.megabytes << 18,), float(member))  # 4-byte floats
    state = elastic.State(step=0)

    @elastic.run
    def exchange(state: elastic.State) -> int:
        while state.step < STEPS:
            lengths = [part.numel()] * px.size()
            if member == args.die_rank and state.step == 1:
                subprocess.Popen(["sh", "-c", f"sleep {args.die_after}; kill -KILL {os.getpid()}"])
                px.allgather(part, async_op=True, check=False, lengths=lengths)
                os.kill(os.getpid(), signal.SIGSTOP)
            gathered = px.allgather(part, check=False, lengths=lengths)
            assert gathered.numel() == part.numel() * px.size()
            state.step += 1
            state.commit()
        return state.step

    steps = exchange(state)
    if px.rank() == 0:
        torch.save({"steps": steps, "size": px.size(),
                    "recoveries": [recovery.__dict__ for recovery in state.recoveries]}, args.out)
    px.shutdown()


if __name__ == "__main__":
    sys.exit(main())

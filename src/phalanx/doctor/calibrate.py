"""Measuring the transport at the end of a doctor session (collective: every rank calls it).

Three sets of figures, each the median of a few repetitions (the fastest for latencies, which
contention from other processes only lengthens):

* the link (:func:`phalanx.comm.collectives.measure_link`): its point-to-point latency and
  per-byte time, and the alpha and beta of the ring formula ``2(p-1) alpha + 2 (p-1)/p n beta``
  as Gloo's own allreduce actually runs it (point-to-point round trips overstate Gloo's allreduce
  latency several times, see docs/transport.md);
* the allreduce the engine uses (shared memory within a host where that is the transport) at a
  small and a large size and at every bucket's size, alone, without backward beside it;
* how long this process takes to copy a byte in memory, from which the shared-memory allreduce
  is predicted where the run used Gloo (:func:`phalanx.doctor.predict.shared_memory_link`).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from phalanx.comm import collectives

SMALL_BYTES = 4 << 10
LARGE_BYTES = 4 << 20
REPEATS = 9


def measure_transport(bucket_bytes: list[int]) -> dict[str, object]:
    """Link, Gloo-ring and engine-allreduce figures of this group, the same keys on every rank."""
    link = collectives.measure_link()
    ring = link.backend or link  # Gloo's own ring (None: the same figures as point to point)
    engine = [_timed(_engine, SMALL_BYTES, min), _timed(_engine, LARGE_BYTES)]
    buckets = [_timed(_engine, size) for size in bucket_bytes]
    scratch = torch.empty(LARGE_BYTES // 4)
    copy_s = _timed(lambda t: scratch.copy_(t), LARGE_BYTES)
    return {"p2p_alpha_s": link.alpha_s, "p2p_beta_s_per_byte": link.beta_s_per_byte,
            "ring_alpha_s": ring.alpha_s, "ring_beta_s_per_byte": ring.beta_s_per_byte,
            "engine_small_s": engine[0], "engine_large_s": engine[1],
            "bucket_bytes": bucket_bytes, "bucket_s": buckets, "copy_s_per_byte": copy_s / LARGE_BYTES}


def _engine(tensor: torch.Tensor) -> object:
    return collectives.allreduce_(tensor, check=False)


def _timed(run: Callable[[torch.Tensor], object], nbytes: int,
           pick: Callable[[list[float]], float] = statistics.median) -> float:
    tensor = torch.zeros(max(nbytes // 4, 1))
    run(tensor)  # warm: buffers, connections
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        run(tensor)
        times.append(time.perf_counter() - started)
    return pick(times)

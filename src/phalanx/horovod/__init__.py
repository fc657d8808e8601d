"""Horovod's API on phalanx: ``import phalanx.horovod.torch as hvd`` instead of ``horovod.torch``.

Nothing to compile: collectives run on :mod:`phalanx.comm.collectives`, ``DistributedOptimizer``
on phalanx's gradient engine, elastic training on :mod:`phalanx.elastic`, and ``phalanx run -np N``
launches the script. See docs/horovod.md for the migration guide and what differs.
"""

"""``px.ParameterServer``: parameters and optimizer state sharded over server processes.

Workers compute gradients and push them; servers (``phalanx run --servers S``) each hold a shard
of the parameters balanced by bytes, apply the user's optimizer to it, and send the parameters
back. ``mode="sync"`` applies one update per global batch from every worker's push and equals
data-parallel training; ``mode="async"`` applies each push as it arrives, deals batches to
workers as they ask (a slow worker takes fewer), and bounds how far ahead a worker may run
with ``max_staleness`` (see docs/strategies.md).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from phalanx.comm import runtime
from phalanx.errors import ConfigurationError
from phalanx.parallel.clipping import Clipping
from phalanx.parallel.data_parallel import DataParallel
from phalanx.strategies.base import (FitOptions, Run, Stateful, Strategy, refuse,
                                     refuse_without_replicas, wrap)
from phalanx.strategies.client import PushToServers, ServerClient, ServerOptimizer
from phalanx.strategies.dealt_epochs import train_dealt
from phalanx.strategies.dealer import Dealer
from phalanx.strategies.placement import groups, place
from phalanx.strategies.server import Server
from phalanx.strategies.shard import Shard

MODES = ("sync", "async")


class ParameterServer(Strategy):
    """``px.fit(..., strategy=px.ParameterServer(mode="sync" | "async", max_staleness=k))``.

    ``max_staleness`` (async only; ``None``: unbounded) holds a worker that has finished more
    than ``k`` batches beyond the slowest worker still computing one, and makes it pull the
    newest parameters before it goes on.
    """

    def __init__(self, mode: str = "sync", max_staleness: int | None = None):
        if mode not in MODES:
            raise ConfigurationError(f"ParameterServer(mode=...) must be 'sync' or 'async', got {mode!r}.")
        if max_staleness is not None and (mode != "async" or max_staleness < 0):
            raise ConfigurationError(
                "max_staleness bounds asynchronous updates: pass mode='async' and a number >= 0 "
                f"(got mode={mode!r}, max_staleness={max_staleness!r}).")
        self.mode = mode
        self.max_staleness = max_staleness
        self.client: ServerClient | None = None
        # workers hold their own gradients and do not meet to compare them: each decides alone
        self.nonfinite_agreement = "local"

    @property
    def name(self) -> str:
        return f"px.ParameterServer(mode={self.mode!r})"

    @property
    def asynchronous(self) -> bool:
        return self.mode == "async"

    # --- worker side ------------------------------------------------------------------------

    def check(self, options: FitOptions) -> None:
        """Refuse what the servers cannot do, naming the pair. They clip the gradient they apply (each
        its shard: synchronous servers sum their squared norms, asynchronous ones cannot meet)."""
        name = f"px.ParameterServer(mode={self.mode!r})"
        if options.precision == "16-mixed":
            refuse(name, "precision='16-mixed' (its scaled gradients)", "the gradients are averaged and applied on "
                   "the servers, where the workers' scaler does not reach; use precision='bf16-mixed', or "
                   "px.DataParallel / px.CentralStorage.")
        norm = options.clipping is not None and options.clipping.max_norm is not None
        if norm and runtime.num_servers() > 1 and self.asynchronous:
            refuse(name, f"clip_grad_norm and {runtime.num_servers()} servers", "each server applies each push as it "
                   "arrives, so no server sees the norm of the whole gradient; use one server, clip_grad_value, "
                   "or mode='sync'.")
        if norm and runtime.num_servers() > 1 and options.elastic:
            refuse(name, f"clip_grad_norm, {runtime.num_servers()} servers and an elastic job", "a step the "
                   "re-formed group redoes would mix the servers' norms of two attempts; use one server, "
                   "clip_grad_value, or a fixed number of workers.")
        refuse_without_replicas(name, "on the servers", options)
        if self.asynchronous and options.checkpoint_every is not None:
            refuse(name, "checkpoint_every", "asynchronous parameter servers checkpoint at epoch ends (mid-epoch, "
                   "the dealt batches are not a position); drop checkpoint_every.")
        if self.asynchronous and options.torch_scheduler:
            refuse(name, "a torch lr scheduler", "each worker applies the steps it is dealt, so no worker sees every "
                   "optimizer step; give lr_schedule a function of the epoch (px.lr.cosine(...)).")

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[DataParallel, ServerOptimizer]:
        """Connect to the servers, hand them the initial parameters, and wrap model and optimizer.
        Workers may train on GPUs: their pushes and the replies cross host memory (the servers' CPU)."""
        wrapped = wrap(model)
        params = [p for p in wrapped.module.parameters() if p.requires_grad]
        self.client = ServerClient(params)
        wrapped.rebuild_reducer(reduction=PushToServers(self.client))
        self.client.initialise()
        return wrapped, ServerOptimizer(optimizer, self.client)

    def train(self, run: Run) -> None:
        """Synchronous: the loop's lockstep epochs. Asynchronous: batches dealt by server 0."""
        if not self.asynchronous:
            run.lockstep()
            return
        assert self.client is not None, "setup comes first"
        train_dealt(run, self.client)

    def committed(self, model: DataParallel, optimizer: ServerOptimizer) -> dict[str, Stateful]:
        """The step count of the optimizer: the servers hold its state and the parameters as of that step."""
        return {"model": model, "optimizer": optimizer.position}

    def memory_needed(self, model: nn.Module, optimizer: Any) -> int:
        """A worker holds the parameters and their gradients; the servers hold the optimizer state."""
        return 2 * sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)

    def worker_clipping(self, clipping: Clipping | None) -> Clipping | None:
        """None: the servers clip the gradient they apply (the workers' own was pushed during backward)."""
        return None

    def finish(self, history: dict[str, Any] | None = None) -> None:
        """Tell the servers this worker is done; worker 0 hands them the history."""
        if self.client is not None:
            self.client.goodbye(history if runtime.rank() == 0 else None)

    def close(self) -> None:
        """Drop the connections without a goodbye: the servers count this worker as lost."""
        if self.client is not None:
            self.client.close()

    # --- server side ------------------------------------------------------------------------

    def serve(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, train_tasks: int = 0,
              val_tasks: int = 0, metric_values: int = 0, clipping: Clipping | None = None) -> dict[str, Any] | None:
        """Serve this process's shard until the workers are done; returns worker 0's history.

        ``train_tasks``/``val_tasks`` per epoch and ``metric_values`` matter in async mode on
        server 0, which deals the tasks and sums the metrics; ``clipping`` clips each applied gradient.
        """
        server = runtime.server_rank()
        params = [p for p in model.parameters() if p.requires_grad]
        shard = Shard(params, optimizer, groups(params, place(params, runtime.num_servers()), server))
        dealer = (Dealer(train_tasks, val_tasks, metric_values, self.max_staleness)
                  if self.asynchronous and server == 0 else None)
        return Server(shard, server, self.mode, runtime.size(), runtime.timeout(), dealer, clipping,
                      runtime.num_servers()).serve()

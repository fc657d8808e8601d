"""A parameter server's serving loop: one thread per worker channel, one lock over the shard.

Synchronous mode: a push waits until every worker of the current group pushed the same step;
the last one to arrive sums the pushes (in worker order), applies one optimizer step and wakes
the others; each replies with the new parameters. A worker lost meanwhile turns the waiting
pushes into ``LOST`` replies and the step is not applied.

Asynchronous mode: each push is applied as it arrives and answered with a copy of the newest
parameters taken under the lock. Server 0 also deals the tasks (see :mod:`.dealer`).

The server returns once every worker that connected said goodbye or was lost (and at least as
many workers as the job has connected), or raises when none came within the timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import Any

import torch

from phalanx.comm import auth, runtime
from phalanx.comm.channel import Channel, ChannelClosed, Listener
from phalanx.comm.connections import own_connection
from phalanx.comm.sealed_store import SealedStore
from phalanx.errors import AuthenticationError, CollectiveTimeoutError
from phalanx.parallel.clipping import Clipping
from phalanx.strategies import protocol as wire
from phalanx.strategies.dealer import Dealer
from phalanx.strategies.protocol import Kind, Request, Status
from phalanx.strategies.shard import Shard

logger = logging.getLogger(__name__)

DEAL_WAIT_S = 0.5  # async: how long a request for a task waits at server 0 before the worker is told to ask again


class Server:
    """Serves ``shard`` to the job's workers until they are done."""

    def __init__(self, shard: Shard, server: int, mode: str, workers: int, timeout_s: float,
                 dealer: Dealer | None = None, clipping: Clipping | None = None, servers: int = 1):
        self.shard = shard
        self.server = server
        self.clipping = clipping
        self.servers = servers
        self._store: Any = None  # this server's own connection to the store, for the clipping norm
        norm_over_servers = servers > 1 and clipping is not None and clipping.max_norm is not None
        self._norm_sum = self._sum_over_servers if norm_over_servers else None  # (synchronous steps only)
        self.mode = mode
        self.workers = workers
        self.timeout_s = timeout_s
        self.dealer = dealer
        self.cond = threading.Condition()
        self.live: set[int] = set()
        self.connected = 0
        self.history: Any = None
        self.step = 0  # synchronous steps applied
        self.version = 0  # updates applied (both modes)
        self.initialised = False
        self._pending: dict[int, list[torch.Tensor]] = {}
        self._pending_rates: list[float] = []
        self._losses = 0
        self._lost_names: list[int] = []
        self._generation = 0  # the newest worker generation seen in a push (elastic jobs re-form)
        self._lost_generation = -1  # pushes of this generation or older cannot complete a step
        self._keep_undo = False  # an elastic job: keep the state before the last step
        self._undo: tuple[int, Any] | None = None  # (step, the shard's state before it was applied)

    def serve(self) -> Any:
        """Serve until every worker is done; return the history worker 0 sent with its goodbye."""
        listener = Listener(runtime.store(), self.server, self.timeout_s, self._on_channel)
        listener.start()
        deadline = time.monotonic() + self.timeout_s
        try:
            with self.cond:
                while self.connected < self.workers or self.live:
                    if self.connected == 0 and time.monotonic() > deadline:
                        raise CollectiveTimeoutError(
                            f"parameter server {self.server}: no worker connected within {self.timeout_s:.0f}s. "
                            "Start workers and servers together with `phalanx run -n W --servers S script.py`.")
                    if self.connected < self.workers and self.connected and not self.live:
                        break  # every worker that came is gone: the job ended without the others
                    self.cond.wait(1.0)
        finally:
            listener.stop()
        return self.history

    # --- one worker ------------------------------------------------------------------------

    def _on_channel(self, worker: int, channel: Channel) -> None:
        with self.cond:
            self.live.add(worker)
            self.connected += 1
        threading.Thread(target=self._serve_worker, args=(worker, channel), daemon=True,
                         name=f"phalanx-ps{self.server}-w{worker}").start()

    def _serve_worker(self, worker: int, channel: Channel) -> None:
        buffers = self.shard.gradient_buffers()
        try:
            while self._handle(worker, channel, buffers):
                pass
        except ChannelClosed as error:
            self._lose(worker, error)
        except Exception as error:  # noqa: BLE001 - tell the worker, then drop it
            logger.exception("parameter server %d: request from worker %d failed", self.server, worker)
            self._fail(channel, worker, error)
        finally:
            channel.close()

    def _handle(self, worker: int, channel: Channel, buffers: list[torch.Tensor]) -> bool:
        """Serve one request; False after the worker's goodbye."""
        head = wire.empty_header()
        channel.recv([head], wire.HEADER)
        request = Request(*head.tolist())
        self._keep_undo = self._keep_undo or bool(request.elastic)
        values = torch.zeros(request.values, dtype=torch.float64)
        if request.values:
            channel.recv([values], wire.VALUES)
        handlers = {Kind.PUSH: self._on_push, Kind.PULL: self._on_pull, Kind.INIT: self._on_parameters,
                    Kind.LOAD: self._on_parameters, Kind.SAVE: self._on_save, Kind.NEXT: self._on_next,
                    Kind.BYE: self._on_goodbye}
        if request.kind not in handlers:
            raise ValueError(f"unknown request kind {request.kind}")
        return handlers[Kind(request.kind)](worker, channel, request, values, buffers) is not False

    # --- requests --------------------------------------------------------------------------

    def _on_push(self, worker: int, channel: Channel, request: Request, values: torch.Tensor,
                 buffers: list[torch.Tensor]) -> None:
        channel.recv(buffers, wire.GROUP_TAG)
        self._push(worker, channel, buffers, request.step, request.generation, request.world, values.tolist())

    def _on_pull(self, worker: int, channel: Channel, request: Request, values: torch.Tensor,
                 buffers: list[torch.Tensor]) -> None:
        self._seek(request.step)
        self._reply_parameters(channel, Status.OK)

    def _on_parameters(self, worker: int, channel: Channel, request: Request, values: torch.Tensor,
                       buffers: list[torch.Tensor]) -> None:
        """INIT (the first worker's initial parameters) or LOAD (a resumed run's, with optimizer state)."""
        flats = [torch.empty_like(flat) for flat in self.shard.flats]
        channel.recv(flats, wire.GROUP_TAG)
        states = wire.recv_object(channel) if request.kind == Kind.LOAD else None
        self._take(flats, states, request.kind == Kind.LOAD)
        channel.send([wire.header(Status.OK)], wire.HEADER)

    def _on_save(self, worker: int, channel: Channel, request: Request, values: torch.Tensor,
                 buffers: list[torch.Tensor]) -> None:
        with self.cond:
            states = self.shard.optimizer_state()
        channel.send([wire.header(Status.OK)], wire.HEADER)
        wire.send_object(channel, states)

    def _on_next(self, worker: int, channel: Channel, request: Request, values: torch.Tensor,
                 buffers: list[torch.Tensor]) -> None:
        self._next(worker, channel, request.epoch, values)

    def _on_goodbye(self, worker: int, channel: Channel, request: Request, values: torch.Tensor,
                    buffers: list[torch.Tensor]) -> bool:
        history = wire.recv_object(channel) if request.step else None
        channel.send([wire.header(Status.OK)], wire.HEADER)
        with self.cond:
            self.history = history if history is not None else self.history
            self.live.discard(worker)
            self.cond.notify_all()
        return False

    def _push(self, worker: int, channel: Channel, buffers: list[torch.Tensor], step: int, generation: int,
              world: int, rates: list[float]) -> None:
        if self.mode == "async":
            with self.cond:
                self.shard.apply(buffers, rates, self.clipping)
                self.version += 1
            self._reply_parameters(channel, Status.OK)
            return
        status, lost = self._push_sync(worker, buffers, step, generation, world, rates)
        if status is Status.OK:
            self._reply_parameters(channel, Status.OK)
        else:
            channel.send([wire.header(status, self.version, lost)], wire.HEADER)

    def _push_sync(self, worker: int, buffers: list[torch.Tensor], step: int, generation: int, world: int,
                   rates: list[float]) -> tuple[Status, int]:
        """Wait until ``world`` workers of this generation pushed ``step``; the last applies it.

        A worker lost meanwhile answers every waiting push, and every later push of the same
        generation, with ``LOST``: its survivors re-form (elastic jobs) and push again as a new
        generation, the step not applied.
        """
        with self.cond:
            if generation <= self._lost_generation:  # a member of this group is gone: the step cannot complete
                return Status.LOST, self._lost_names[-1]
            self._generation = max(self._generation, generation)
            if step != self.step:
                raise ValueError(f"worker {worker} pushed step {step}, but this server is at step {self.step}: "
                                 "the workers and the server disagree on the position (a resumed run?)")
            losses = self._losses
            self._pending[worker] = buffers
            self._pending_rates = rates
            if len(self._pending) >= world:
                self._apply_pending()
                return Status.OK, -1
            deadline = time.monotonic() + self.timeout_s
            while self.step == step and self._losses == losses:
                if not self.cond.wait(max(0.0, deadline - time.monotonic())):
                    raise CollectiveTimeoutError(
                        f"parameter server {self.server}: step {step} still lacks pushes from "
                        f"{world - len(self._pending)} worker(s) after {self.timeout_s:.0f}s")
            if self.step > step:
                return Status.OK, -1
            self._pending.pop(worker, None)
            return Status.LOST, self._lost_names[-1]

    def _apply_pending(self) -> None:
        """Sum the pushes in worker order, apply one step, wake the waiting pushes."""
        if self._keep_undo:
            self._undo = (self.step, self.shard.snapshot())
        order = sorted(self._pending)
        total = [buffer.clone() for buffer in self._pending[order[0]]]
        for worker in order[1:]:
            for summed, buffer in zip(total, self._pending[worker]):
                summed.add_(buffer)
        self.shard.apply(total, self._pending_rates, self.clipping, self._norm_sum)
        self._pending.clear()
        self.step += 1
        self.version += 1
        self.cond.notify_all()

    def _sum_over_servers(self, value: float) -> float:
        """``value`` summed over every server at this step, in server order (so the same sum on each),
        through the rendezvous store: the servers share no group. Each part is sealed with the job's
        secret, so a part someone else wrote is waited past, never added. Called under the lock."""
        if self._store is None:
            self._store = SealedStore(own_connection(runtime.store()),
                                      auth.required("a parameter server", "launch with phalanx run --servers"),
                                      self.timeout_s)

        def key(server: int, step: int) -> str:
            return f"phalanx/ps/squared-norm/{step}/{server}"
        self._store.set(key(self.server, self.step), repr(value))
        keys = [key(server, self.step) for server in range(self.servers)]
        try:
            self._store.wait(keys, timedelta(seconds=self.timeout_s))
        except RuntimeError as error:
            raise CollectiveTimeoutError(
                f"parameter server {self.server}: step {self.step}'s gradient norm lacks another server's part "
                f"after {self.timeout_s:.0f}s (clip_grad_norm sums it over the servers): {error}") from error
        try:
            total = sum(float(self._store.get(k)) for k in keys)
        except AuthenticationError as error:
            raise AuthenticationError(
                f"parameter server {self.server}: step {self.step}'s gradient norm was not summed: {error} "
                f"(still after {self.timeout_s:.0f}s), so something other than this job writes to the store's port. "
                "Keep the port private: see docs/security.md.") from error
        if self.step:  # every server read the previous step's parts before any worker could push this step
            self._store.delete_key(key(self.server, self.step - 1))
        return total

    def _seek(self, step: int) -> None:
        """Sync: a worker restored the state of ``step``; go back to it if this server is one step ahead."""
        if self.mode == "async":
            return
        with self.cond:
            if step == self.step:
                return
            if self._undo is None or self._undo[0] != step:
                raise ValueError(f"a worker restored step {step}, but this server is at step {self.step} and can "
                                 "go back one step at most")
            self.shard.restore(self._undo[1])
            self.step, self._undo = step, None
            self.version += 1
            logger.warning("parameter server %d: went back to step %d, which the re-formed group redoes",
                           self.server, step)

    def _reply_parameters(self, channel: Channel, status: Status) -> None:
        """The newest parameters: async pushes keep changing them, so a copy taken under the lock."""
        if self.mode == "async":
            with self.cond:
                version, flats = self.version, [flat.clone() for flat in self.shard.flats]
        else:
            version, flats = self.version, self.shard.flats  # nothing changes them before every worker pushed again
        channel.send([wire.header(status, version)], wire.HEADER)
        channel.send(flats, wire.GROUP_TAG)

    def _take(self, flats: list[torch.Tensor], states: Any, resumed: bool) -> None:
        """Initial parameters (the first worker's, once) or a resumed run's parameters and state."""
        with self.cond:
            if resumed:
                self.shard.load_parameters(flats)
                self.shard.load_optimizer_state(states["optimizer"])
                self.step = self.version = int(states["step"])
            elif not self.initialised:
                self.shard.load_parameters(flats)
            self.initialised = True

    def _next(self, worker: int, channel: Channel, epoch: int, sums: torch.Tensor) -> None:
        """Async, server 0: count the worker's last task, then deal it another, say the epoch is done,
        or, when nothing can be dealt within ``DEAL_WAIT_S``, say ``WAIT``.

        A worker is never held here for long: the tasks it waits for may be held by workers that
        are re-forming their group (an elastic job), which needs this worker too, so it goes back,
        follows its group and asks again; the client bounds the whole wait by the job's timeout.
        """
        assert self.dealer is not None
        waited = False
        deadline = time.monotonic() + DEAL_WAIT_S
        with self.cond:
            self.dealer.confirm(worker, sums)
            self.cond.notify_all()
            while (dealt := self.dealer.deal(worker, epoch)) is None:
                waited = True
                if not self.cond.wait(max(0.0, deadline - time.monotonic())):
                    break
            if dealt is not None:
                self.cond.notify_all()
            totals = self.dealer.finished.get(epoch)
            applied = self.dealer.applied
        if dealt is None:
            channel.send([wire.header(Status.WAIT, 1, 0, self.workers, applied, epoch)], wire.HEADER)
            return
        what, task, phase = dealt
        if what == "done":
            assert totals is not None
            channel.send([wire.header(Status.EPOCH_DONE, 0, 0, 0, 0, epoch, 0, totals.numel())], wire.HEADER)
            channel.send([totals], wire.VALUES)
        else:
            channel.send([wire.header(Status.TASK, int(waited), int(phase), self.workers, applied, epoch, task)],
                         wire.HEADER)

    # --- failures --------------------------------------------------------------------------

    def _lose(self, worker: int, error: BaseException) -> None:
        with self.cond:
            if worker not in self.live:
                return
            self.live.discard(worker)
            self._pending.pop(worker, None)
            self._losses += 1
            self._lost_generation = self._generation
            self._lost_names.append(worker)
            if self.dealer is not None:
                self.dealer.lose(worker)
            self.cond.notify_all()
        logger.warning("parameter server %d: lost worker %d (%s)", self.server, worker, error)

    def _fail(self, channel: Channel, worker: int, error: BaseException) -> None:
        try:
            channel.send([wire.header(Status.FAILED)], wire.HEADER)
            wire.send_object(channel, f"parameter server {self.server}: {error}")
        except ChannelClosed:
            pass
        self._lose(worker, error)

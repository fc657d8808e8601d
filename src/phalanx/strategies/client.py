"""The worker's side of a parameter-server job: channels, the pushing reduction, the pulling optimizer.

The gradient engine does the pushing: :class:`PushToServers` is a
:class:`~phalanx.parallel.reductions.Reduction` whose buckets are the servers' parameter groups
(so a bucket is one message, sent as soon as backward completes it) and whose weights are the
sample counts (the server divides the sum by the counts in the trailers). :class:`ServerOptimizer`
holds the user's optimizer for its hyperparameters only: its ``step()`` receives the servers'
new parameters, and its ``state_dict()`` fetches the optimizer state the servers hold.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from phalanx.comm import channel as channels, collectives, runtime
from phalanx.comm.channel import Channel, ChannelClosed
from phalanx.errors import CheckpointError, CollectiveTimeoutError, ConfigurationError, ServerFailedError
from phalanx.parallel.buckets import Bucket
from phalanx.parallel.reductions import Reduction, Waitable
from phalanx.parallel.weights import SampleWeights, Weights
from phalanx.strategies import protocol as wire
from phalanx.strategies.held import HeldOptimizer
from phalanx.strategies.placement import Group, all_groups
from phalanx.strategies.protocol import Kind, Phase, Status

logger = logging.getLogger(__name__)


class ServerClient:
    """This worker's channels to every parameter server, and the step protocol over them."""

    def __init__(self, params: Sequence[torch.nn.Parameter]):
        self.params = list(params)
        self.servers = runtime.num_servers()
        if self.servers < 1:
            raise ConfigurationError(
                "px.ParameterServer needs parameter-server processes: launch with `phalanx run -n W --servers S "
                "script.py` (S >= 1); px.CentralStorage() trains without them.")
        self.groups = all_groups(self.params, self.servers)
        self.by_params = {group.params: group for group in self.groups}
        self.step = 0
        self.rates: Callable[[], list[float]] = lambda: []
        self._pushed: set[int] = set()  # servers that got this step's header
        self._received = [torch.empty(group.numel, dtype=group.dtype) for group in self.groups]
        self.channels = [self._connect(server) for server in range(self.servers)]

    def _connect(self, server: int) -> Channel:
        try:
            return channels.connect(runtime.store(), server, runtime.worker_id(), runtime.timeout())
        except ChannelClosed as error:
            raise self._server_failed(server, "connect to", error) from error

    def server_groups(self, server: int) -> list[Group]:
        return [group for group in self.groups if group.server == server]

    # --- one step ---------------------------------------------------------------------------

    def push(self, bucket: Bucket) -> Waitable:
        """Send one complete bucket (a server's group) to its server; the header goes with the first.
        A GPU worker's bucket travels through host memory: the channels carry CPU tensors."""
        group = self.by_params[tuple(bucket.param_indices)]
        server = group.server
        payload = bucket.flat.cpu()
        try:
            if server not in self._pushed:
                self._send_header(server, Kind.PUSH, self.rates())
                self._pushed.add(server)
            works = self.channels[server].isend([payload], wire.GROUP_TAG + group.index)
        except ChannelClosed as error:
            raise self._server_failed(server, "push a gradient to", error) from error
        return _Sends(self, server, works, payload)

    def finish_step(self) -> None:
        """Receive every server's reply to this step's pushes and take the new parameters."""
        if not self._pushed:
            raise ConfigurationError(
                "optimizer.step() without a synchronised backward: under px.ParameterServer the step receives the "
                "parameters the servers computed from this step's pushed gradients, so call loss.backward() first.")
        servers, self._pushed = sorted(self._pushed), set()
        for server in servers:
            self._receive_parameters(server, "receive the parameters from")
        self.step += 1

    def next_task(self, epoch: int, sums: torch.Tensor | None) -> Task:
        """Async: report the last task's metric sums to server 0 and get the next task of ``epoch``.

        Returns a task (its ``waited`` says the staleness bound held this worker back, so it
        should pull first), one with status ``EPOCH_DONE`` and the epoch's summed metrics
        (training, then validation) in ``totals``, or one with status ``WAIT``: nothing could be
        dealt yet, ask again (after following the group: the holders of the last tasks may be
        re-forming it).
        """
        values = [] if sums is None else sums.tolist()
        self._request(0, Kind.NEXT, values, epoch=epoch)
        status, waited, phase, shares, applied, _, task, totals_len = self._reply(0, "get the next batch from")
        if status == Status.EPOCH_DONE:
            totals = torch.zeros(totals_len, dtype=torch.float64)
            try:
                self.channels[0].recv([totals], wire.VALUES)
            except ChannelClosed as error:
                raise self._server_failed(0, "get the epoch's metrics from", error) from error
            return Task(Status.EPOCH_DONE, totals=totals)
        if status == Status.WAIT:
            return Task(Status.WAIT)
        step, share = divmod(task, shares)
        return Task(Status.TASK, Phase(phase), step, share, shares, bool(waited), applied // shares)

    def deal(self, epoch: int, before_each: Callable[[], None]) -> Dealing:
        """Async: ``epoch``'s tasks from server 0, as the training loop iterates them (see :class:`Dealing`)."""
        return Dealing(self, epoch, before_each)

    def pull(self) -> None:
        """Fetch the newest parameters from every server."""
        for server in range(self.servers):
            self._request(server, Kind.PULL)
        for server in range(self.servers):
            self._receive_parameters(server, "pull the parameters from")

    def _receive_parameters(self, server: int, operation: str) -> None:
        reply = self._reply(server, operation)
        status, _, lost = reply[:3]
        if status == Status.LOST:  # a membership failure: elastic jobs re-form and push the step again
            raise CollectiveTimeoutError(
                f"rank {runtime.rank()}: worker {lost} was lost before step {self.step} was complete, so "
                f"parameter server {server} did not apply it. Launch with --min-workers to go on without lost workers.")
        mine = [(k, group) for k, group in enumerate(self.groups) if group.server == server]
        try:
            self.channels[server].recv([self._received[k] for k, _ in mine], wire.GROUP_TAG)
        except ChannelClosed as error:
            raise self._server_failed(server, operation, error) from error
        with torch.no_grad():
            for k, group in mine:
                offset = 0
                for index, numel in zip(group.params, group.numels):
                    param = self.params[index]
                    param.copy_(self._received[k][offset:offset + numel].view_as(param))
                    offset += numel

    # --- set-up, checkpoints, the end -------------------------------------------------------

    def initialise(self) -> None:
        """Rank 0 gives the servers the initial parameters (the same on every rank); all wait for it."""
        if runtime.rank() == 0:
            for server in range(self.servers):
                self._send_parameters(server, Kind.INIT)
        collectives.barrier()

    def optimizer_state(self) -> dict[int, Any]:
        """Every server's optimizer state, keyed by model parameter index."""
        states: dict[int, Any] = {}
        for server in range(self.servers):
            self._request(server, Kind.SAVE)
            self._reply(server, "fetch the optimizer state from")
            states.update(self._object(server))
        return states

    def load(self, states: dict[int, Any], step: int) -> None:
        """Rank 0 sends the restored parameters and optimizer state to the servers; all wait for it."""
        if runtime.rank() == 0:
            for server in range(self.servers):
                mine = {index: state for index, state in states.items()
                        if any(index in group.params for group in self.server_groups(server))}
                self._send_parameters(server, Kind.LOAD, {"optimizer": mine, "step": step})
        self.step = step
        collectives.barrier()

    def goodbye(self, history: Any = None) -> None:
        """Tell every server this worker is done (worker 0 hands them the history)."""
        for server, channel in enumerate(self.channels):
            try:
                self._send_header(server, Kind.BYE, [], step=int(history is not None))
                if history is not None:
                    wire.send_object(channel, history)
                self._reply(server, "say goodbye to")
            except (ServerFailedError, ChannelClosed) as error:
                logger.warning("%s", error)
            channel.close()

    def close(self) -> None:
        """Drop every channel at once (a failing worker): servers see the connection end."""
        for channel in self.channels:
            channel.close()

    def _send_parameters(self, server: int, kind: Kind, states: Any = None) -> None:
        flats = [torch.cat([self.params[i].detach().reshape(-1) for i in group.params]).cpu()
                 for group in self.server_groups(server)]
        self._send_header(server, kind, [])
        try:
            self.channels[server].send(flats, wire.GROUP_TAG)
            if states is not None:
                wire.send_object(self.channels[server], states)
        except ChannelClosed as error:
            raise self._server_failed(server, "send the parameters to", error) from error
        self._reply(server, "send the parameters to")

    # --- the wire ---------------------------------------------------------------------------

    def _request(self, server: int, kind: Kind, values: Sequence[float] = (), epoch: int = 0) -> None:
        self._send_header(server, kind, values, epoch=epoch)

    def _send_header(self, server: int, kind: Kind, values: Sequence[float], step: int | None = None,
                     epoch: int = 0) -> None:
        """Send a request's header and values, and wait until they are sent (Gloo cancels dropped sends)."""
        membership = runtime.membership()
        head = wire.header(kind, self.step if step is None else step, membership.generation if membership else 0,
                           runtime.size(), int(runtime.is_elastic()), epoch, 0, len(values))
        tensors = [head] + ([torch.tensor(list(values), dtype=torch.float64)] if len(values) else [])
        try:
            self.channels[server].send(tensors[:1], wire.HEADER)
            if len(tensors) > 1:
                self.channels[server].send(tensors[1:], wire.VALUES)
        except ChannelClosed as error:
            raise self._server_failed(server, "send a request to", error) from error

    def _reply(self, server: int, operation: str) -> list[int]:
        head = wire.empty_header()
        try:
            self.channels[server].recv([head], wire.HEADER)
        except ChannelClosed as error:
            raise self._server_failed(server, operation, error) from error
        fields = head.tolist()
        if fields[0] == Status.FAILED:
            raise ServerFailedError(f"rank {runtime.rank()}: {self._object(server)}")
        return fields

    def _object(self, server: int) -> Any:
        try:
            return wire.recv_object(self.channels[server])
        except ChannelClosed as error:
            raise self._server_failed(server, "receive from", error) from error

    def _server_failed(self, server: int, operation: str, error: BaseException) -> ServerFailedError:
        return ServerFailedError(
            f"rank {runtime.rank()}: could not {operation} parameter server {server}: {error} It died or stopped "
            "answering; the last checkpoint is intact: start the job again with resume=True to continue from it.")


@dataclass(frozen=True)
class Task:
    """What server 0 dealt: share ``share`` of ``shares`` of global batch ``step``, or the epoch's end."""

    status: Status
    phase: Phase = Phase.TRAIN
    step: int = 0
    share: int = 0
    shares: int = 1  # a global batch's shares: the job's workers when it started
    waited: bool = False
    progress: int = 0  # global batches of the epoch fully applied when this task was dealt
    totals: torch.Tensor | None = None

    @property
    def training(self) -> bool:
        """A training batch (else a validation batch)."""
        return self.phase is Phase.TRAIN


class Dealing:
    """One epoch's tasks dealt by server 0 (asynchronous mode), as the training loop sees them.

    Iterating yields each task, after ``before_each`` (an elastic job follows its group there) and
    after pulling the newest parameters where the staleness bound held this worker back or
    validation begins; :meth:`report` hands in the last task's metric sums, which travel with the
    next request. After the last task this worker holds the final parameters and ``totals`` the
    epoch's summed metrics (training, then validation). The wire protocol stays in this module.
    """

    def __init__(self, client: ServerClient, epoch: int, before_each: Callable[[], None]):
        self.client, self.epoch, self.before_each = client, epoch, before_each
        self.totals: torch.Tensor | None = None
        self._sums: torch.Tensor | None = None

    def __iter__(self) -> Iterator[Task]:
        phase_seen, waiting_since = None, None
        while True:
            self.before_each()
            task, self._sums = self.client.next_task(self.epoch, self._sums), None
            if task.status is Status.WAIT:
                waiting_since = self._still_waiting(waiting_since)
                continue
            if task.status is Status.EPOCH_DONE:
                self.totals = task.totals
                self.client.pull()  # every update of the epoch is applied: the same parameters everywhere
                return
            if task.waited or waiting_since is not None or task.phase != phase_seen:
                self.client.pull()
                phase_seen = task.phase
            waiting_since = None
            yield task

    def _still_waiting(self, since: float | None) -> float:
        """When this worker began waiting for a task; raises once that is longer than the job's timeout."""
        now = time.monotonic()
        if since is None:
            return now
        if now - since > runtime.timeout():
            raise CollectiveTimeoutError(
                f"rank {runtime.rank()}: parameter server 0 dealt no task of epoch {self.epoch} for "
                f"{runtime.timeout():.0f}s: the workers holding the epoch's last tasks never finished them. "
                "Look for a stopped worker in the log; launch with --min-workers to go on without lost workers.")
        return since

    def report(self, sums: torch.Tensor) -> None:
        """The metric sums of the task just done."""
        self._sums = sums


class _Sends:
    """The pushes of one bucket; waiting means they were handed to the network (``payload``, the
    tensor sent, lives until then)."""

    def __init__(self, client: ServerClient, server: int, works: list[Any], payload: torch.Tensor):
        self.client, self.server, self.works, self.payload = client, server, works, payload

    def wait(self) -> None:
        try:
            self.client.channels[self.server].wait(self.works, "push a gradient to")
        except ChannelClosed as error:
            raise self.client._server_failed(self.server, "push a gradient to", error) from error


class PushToServers(Reduction):
    """The reduction of a parameter-server worker: each bucket is one server group, pushed as it completes."""

    name = "push to parameter servers"

    def __init__(self, client: ServerClient):
        self.client = client

    def weights(self) -> Weights:
        """Each worker's sample count, with no collective among workers: the servers divide by the
        summed counts (asynchronous workers never meet)."""
        return SampleWeights()

    def bucket_groups(self, groups: list[list[int]], params: Sequence[torch.Tensor]) -> list[list[int]]:
        """One bucket per server group, launched in the order their first gradients become ready."""
        readiness = {index: position for position, index in enumerate(i for group in groups for i in group)}
        ordered = sorted(self.client.groups, key=lambda g: min(readiness.get(i, len(readiness)) for i in g.params))
        return [list(group.params) for group in ordered]

    def reduce(self, bucket: Bucket) -> Waitable:
        return self.client.push(bucket)


class ServerOptimizer(HeldOptimizer):
    """The user's optimizer, stepped on the parameter servers.

    ``param_groups`` are the user's (learning-rate schedules set them here and every push carries
    the rates); ``state`` stays empty on workers. ``step()`` waits for the servers' new parameters.
    """

    strategy = "px.ParameterServer"

    def __init__(self, optimizer: torch.optim.Optimizer, client: ServerClient):
        super().__init__(optimizer)
        self.client = client
        client.rates = lambda: [float(group["lr"]) for group in optimizer.param_groups]
        position = {id(param): index for index, param in enumerate(client.params)}
        self._model_index = [position.get(id(p), -1) for g in optimizer.param_groups for p in g["params"]]

    def _step(self) -> None:
        """Receive the parameters the servers computed from this step's gradients."""
        self.client.finish_step()

    @property
    def position(self) -> "StepPosition":
        """What an elastic commit needs: the step count (the servers hold the rest, as of that step)."""
        return StepPosition(self.client)

    def state_dict(self) -> dict[str, Any]:
        """The user's optimizer's state dict, with the state the servers hold (a round trip to each)."""
        by_model = self.client.optimizer_state()
        own = self.optimizer.state_dict()
        own["state"] = {k: by_model[i] for k, i in enumerate(self._model_index) if i in by_model}
        own["phalanx_step"] = self.client.step
        return own

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Hyperparameters here; parameters and optimizer state to the servers (collective over workers)."""
        if "param_groups" not in state_dict:
            raise CheckpointError(
                "this state holds only a parameter-server job's step (an elastic commit, elastic-last.pt), not the "
                "servers' optimizer state: resume from a regular checkpoint (checkpoint_every=N) instead.")
        state = dict(state_dict)
        step = int(state.pop("phalanx_step", 0))
        self.optimizer.load_state_dict({**state, "state": {}})
        by_model = {self._model_index[k]: value for k, value in state.get("state", {}).items()}
        self.client.load(by_model, step)


class StepPosition:
    """A worker's place in synchronous parameter-server training, committed by elastic jobs every step.

    The servers apply a step only once every worker of the group pushed it, so their state is
    that of the last step the workers committed, or one step newer when the group broke during
    the commit itself: restoring takes the step count back and pulls that step's parameters
    (servers of an elastic job keep the state before their last step for this).
    """

    def __init__(self, client: ServerClient):
        self.client = client

    def state_dict(self) -> dict[str, int]:
        return {"step": self.client.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.client.step = int(state["step"])
        self.client.pull()

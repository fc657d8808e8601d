"""The coordinator: decides who belongs to each generation of an elastic job.

It runs as a thread in the launcher of node 0, beside the rendezvous store, so it outlives every
worker. Everything reaches it through the store's inbox queue (see :class:`phalanx.comm.membership.Keys`):

- ``spawn`` and ``exit`` from the launchers, when they start a worker and when one exits;
- ``request`` from workers asking for a place in the next generation: founders at ``px.init()``
  (``"start"``), survivors after a failure (``"failure"``), every member at an agreed step
  boundary (``"planned"``), and workers started after the job did (``"join"``).

It watches each member's heartbeat counter; a member whose counter stops for
``heartbeat_timeout_s`` is declared dead, the generation is marked broken (so every survivor's
pending collective fails at once) and the member's launcher is told to kill it, so that a frozen
process cannot come back as a zombie member.

A new generation is published once every member of the current one has either asked for it or
is gone; joiners are added at the end (so survivors keep their relative order) up to the maximum.
Fewer than ``min_workers`` ends the job: every survivor is told so, the first of them is asked to
save a checkpoint, and ``Keys.STATUS`` records why for the launchers.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from phalanx.comm import auth
from phalanx.comm.membership import Keys, Statements
from phalanx.errors import AuthenticationError

POLL_INTERVAL_S = 0.02
RETRY_S = 0.5  # while the store fails: how often the coordinator tries again (no log line per try)
HEARTBEAT_POLL_S = 0.2


@dataclass
class _Member:
    id: int
    node: int = 1 << 30
    local_rank: int = 0
    label: str = "?"
    exit_code: int | None = None
    left: bool = False  # shut down on purpose (px.shutdown()): done, like an exit with 0
    dead: str | None = None  # why it was declared dead (no heartbeat, did not rejoin)
    heartbeat: int = -1  # -1 until its first request: only members that reached px.init() beat
    beat_at: float = 0.0
    spawned_at: float | None = None

    @property
    def gone(self) -> bool:
        return self.left or self.exit_code is not None or self.dead is not None

    @property
    def finished(self) -> bool:
        return self.left or self.exit_code == 0

    def describe(self) -> str:
        where = f"node {self.node}, " if 0 < self.node < 1 << 30 else ""
        return f"worker {self.label} ({where}member {self.id})"


@dataclass
class _Request:
    member: int
    seq: int
    generation: int
    reason: str
    order: int


@dataclass
class CoordinatorConfig:
    """``rendezvous_timeout_s`` bounds how long a generation waits for a member to rejoin;
    ``start_timeout_s`` how long generation 0 waits for workers still starting (default: the same)."""

    min_workers: int
    max_workers: int
    heartbeat_timeout_s: float
    rendezvous_timeout_s: float
    start_timeout_s: float | None = None

    @property
    def start_timeout(self) -> float:
        return self.rendezvous_timeout_s if self.start_timeout_s is None else self.start_timeout_s


@dataclass
class _Formation:
    """A generation change in progress: since when, and why."""

    since: float
    event_time: float
    reason: str
    lost: list[int] = field(default_factory=list)


class Coordinator:
    """Forms generations from the messages in the store's inbox. :meth:`step` is one poll."""

    def __init__(self, store: Any, secret: auth.JobSecret, config: CoordinatorConfig,
                 log: Callable[[str], None] | None = None):
        self.store = store
        self.secret = secret
        self.ledger = auth.NonceLedger()
        self.config = config
        self.log = log or (lambda message: None)
        self.members: dict[int, _Member] = {}
        self.requests: dict[int, _Request] = {}
        self.generation = -1
        self.current: list[int] = []
        self.status: str | None = None  # "failed: ..." or "finished"
        self._formation: _Formation | None = None
        self._signalled = False
        self._order = 0
        self._first_request: float | None = None
        self._last_heartbeat_poll = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.statements = Statements(store, secret, share=True)  # broken/signal flags, the members' heartbeats
        #: why the coordinator gave up (its store failed for a heartbeat timeout on end): the launcher stops
        self.failure: str | None = None

    # --- running ----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="phalanx-coordinator", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _loop(self) -> None:
        failing_since: float | None = None
        while not self._stop.wait(POLL_INTERVAL_S if failing_since is None else RETRY_S):
            try:
                self.step()
                failing_since = None
            except Exception as error:  # noqa: BLE001 - a coordinator that dies silently hangs the job
                now = time.monotonic()
                if failing_since is None:  # once per failure: a new connection may be all it needs
                    failing_since = now
                    first_line = (str(error).splitlines() or [""])[0][:200]  # torch appends C++ frames
                    self.log(f"phalanx run: elastic coordinator error: {type(error).__name__}: {first_line}; "
                             "retrying on a new connection")
                elif now - failing_since > self.config.heartbeat_timeout_s:
                    self.failure = (f"the elastic coordinator on node 0 could not use the store for "
                                    f"{now - failing_since:.0f}s ({str(error).splitlines()[0][:200]})")
                    self.log(f"phalanx run: error: {self.failure}; stopping the job.")
                    return
                self._reconnect()

    def _reconnect(self) -> None:
        with self._lock, contextlib.suppress(RuntimeError, OSError):
            self.store = self.store.clone()  # within the store's own timeout: the loop retries until the heartbeat timeout
            self.statements = Statements(self.store, self.secret, share=True)

    def busy(self) -> bool:
        """Whether a member may still need the store: one that joined and is not gone, or one still
        starting (for at most the rendezvous timeout: a lost host's workers never report)."""
        now = time.monotonic()
        if self.failure is not None:
            return False
        with self._lock:
            return any(not m.gone and (m.heartbeat >= 0 or (m.spawned_at is not None and
                                                            now - m.spawned_at < self.config.start_timeout))
                       for m in self.members.values())

    def step(self) -> None:
        """Read the inbox, check heartbeats, and form a generation when one is due."""
        with self._lock:
            now = time.monotonic()
            self._drain(now)
            if now - self._last_heartbeat_poll >= HEARTBEAT_POLL_S:
                self._last_heartbeat_poll = now
                self._check_heartbeats(now)
            self._decide(now)

    # --- messages ---------------------------------------------------------------------------

    def _drain(self, now: float) -> None:
        pending = self.store.queue_len(Keys.INBOX)
        for _ in range(pending):
            message = self._opened(self.store.queue_pop(Keys.INBOX, False))
            if message is not None:
                self._handle(message, now)

    def _opened(self, sealed: bytes) -> dict[str, Any] | None:
        """An inbox message that proves the job's secret and was not seen before; else a warning."""
        try:
            text, nonce = self.secret.open(Keys.INBOX, sealed)
        except AuthenticationError:
            self.log("phalanx run: warning: refused a message on the job's inbox that does not carry the job's "
                     "secret (a node or client started without it, or with another job's); the job goes on.")
            return None
        if not self.ledger.first_time(nonce):
            self.log("phalanx run: warning: refused a replayed message on the job's inbox (sealed once, sent "
                     "again); the job goes on.")
            return None
        return dict(json.loads(text))

    def _member(self, member_id: int) -> _Member:
        if member_id not in self.members:
            self.members[member_id] = _Member(member_id, label=str(member_id))
        return self.members[member_id]

    def _handle(self, message: dict[str, Any], now: float) -> None:
        kind = message.get("type")
        if kind == "hello":  # another node's launcher proved the secret; its workers announce themselves
            return
        member = self._member(int(message["member"]))
        if kind == "spawn":
            member.node = int(message.get("node", 0))
            member.local_rank = int(message.get("local_rank", 0))
            member.label = str(message.get("label", member.id))
            member.spawned_at = now
        elif kind == "exit":
            self._on_exit(member, int(message["code"]), float(message.get("time", time.time())))
        elif kind == "leave":
            member.left = True
            self.requests.pop(member.id, None)
            self._check_finished()
        elif kind == "request":
            self._on_request(member, message, now)

    def _on_exit(self, member: _Member, code: int, when: float) -> None:
        member.exit_code = code
        self.requests.pop(member.id, None)
        if member.id in self.current and code != 0 and member.dead is None and not member.left:
            self._break(f"{member.describe()} exited with code {code}", when, member.id)
        self._check_finished()

    def _check_finished(self) -> None:
        if self.generation >= 0 and self.current and all(self.members[m].finished for m in self.current):
            self.status = self.status or "finished"

    def _on_request(self, member: _Member, message: dict[str, Any], now: float) -> None:
        self._order += 1
        request = _Request(member.id, int(message["seq"]), int(message["generation"]), str(message["reason"]),
                           self._order)
        member.left = False
        if member.heartbeat < 0:
            member.heartbeat, member.beat_at = 0, now
        if request.reason == "start" and self.generation >= 0:
            self._answer(request, {"status": "late", "generation": self.generation})  # px.elastic.run asks again
            return
        if self.status is not None:
            self._answer_closed(request)
            return
        if member.dead is not None:
            self._answer(request, {"status": "excluded", "message": (
                f"{member.describe()} was declared dead ({member.dead}) and removed from the job.")})
            return
        if request.reason == "start":
            self._first_request = self._first_request or now
        elif request.reason in ("failure", "planned"):
            if member.id not in self.current or request.generation != self.generation:
                self._answer(request, {"status": "excluded", "message": (
                    f"{member.describe()} asked to leave generation {request.generation}, but the job is in "
                    f"generation {self.generation} without it.")})
                return
            if self._formation is None:
                self._formation = _Formation(now, float(message.get("time", time.time())), request.reason)
            if request.reason == "failure":
                self._formation.reason = "failure"
        self.requests[member.id] = request

    # --- liveness ---------------------------------------------------------------------------

    def _check_heartbeats(self, now: float) -> None:
        watched = [m for m in self.members.values() if m.heartbeat >= 0 and not m.gone]
        for member in watched:
            stated = self.statements.read(Keys.heartbeat(member.id))  # forged or absent: no sign of life
            beat = member.heartbeat if stated is None else int(stated)
            if beat > member.heartbeat:  # a beat replayed from earlier is no sign of life either
                member.heartbeat, member.beat_at = beat, now
            elif now - member.beat_at > self.config.heartbeat_timeout_s:
                self._declare_dead(member, f"no heartbeat for {now - member.beat_at:.1f}s")

    def _declare_dead(self, member: _Member, why: str) -> None:
        member.dead = why
        self.requests.pop(member.id, None)
        self.store.set(Keys.kill(member.id), self.secret.seal(Keys.kill(member.id), why))  # no zombie member
        self.log(f"phalanx run: {member.describe()} is declared dead: {why}; its launcher kills it.")
        if member.id in self.current:
            self._break(f"{member.describe()}: {why}", time.time(), member.id)

    def _break(self, why: str, when: float, lost: int) -> None:
        """Mark the current generation broken: survivors abort their collectives and rejoin."""
        if self.generation < 0:
            return
        self.statements.state(Keys.broken(self.generation))
        self.statements.state(Keys.signal(self.generation))
        if self._formation is None:
            self._formation = _Formation(time.monotonic(), when, "failure")
        self._formation.reason = "failure"
        self._formation.event_time = min(self._formation.event_time, when)
        self._formation.lost.append(lost)

    # --- forming generations ----------------------------------------------------------------

    def _decide(self, now: float) -> None:
        if self.status is not None:
            for request in list(self.requests.values()):
                self._answer_closed(request)
            return
        if self.generation < 0:
            self._decide_first(now)
            return
        joiners = self._joiners()
        if self._formation is None:
            if joiners and len(self.current) < self.config.max_workers and not self._signalled:
                self.statements.state(Keys.signal(self.generation))  # members end it at a step boundary
                self._signalled = True
            return
        waiting = [m for m in self.current if m not in self.requests and not self.members[m].gone]
        if waiting:
            if now - self._formation.since <= self.config.rendezvous_timeout_s:
                return
            for member_id in waiting:
                self._declare_dead(self.members[member_id],
                                   f"did not rejoin within {self.config.rendezvous_timeout_s:.0f}s")
        survivors = [m for m in self.current if m in self.requests]
        if not survivors and any(self.members[m].finished for m in self.current):
            self.status = "finished"  # the others completed; the failure came after their last step
            return
        room = max(0, self.config.max_workers - len(survivors))
        self._form(survivors + joiners[:room], self._formation.reason, self._formation.event_time)

    def _decide_first(self, now: float) -> None:
        founders = [r.member for r in sorted(self.requests.values(), key=lambda r: r.order) if r.reason == "start"]
        starting = [m for m in self.members.values() if not m.gone and m.id not in self.requests]
        if founders and not starting and len(founders) >= self.config.min_workers:
            ordered = sorted(founders, key=lambda m: (self.members[m].node, self.members[m].local_rank, m))
            self._form(ordered[: self.config.max_workers], "start", time.time())
        elif self._first_request is not None and now - self._first_request > self.config.start_timeout:
            if len(founders) >= self.config.min_workers:
                ordered = sorted(founders, key=lambda m: (self.members[m].node, self.members[m].local_rank, m))
                self._form(ordered[: self.config.max_workers], "start", time.time())
            else:
                self._fail(f"only {len(founders)} worker(s) started within {self.config.start_timeout:.0f}s, "
                           f"fewer than --min-workers {self.config.min_workers}", founders)

    def _joiners(self) -> list[int]:
        return [r.member for r in sorted(self.requests.values(), key=lambda r: r.order) if r.reason == "join"]

    def _form(self, members: list[int], reason: str, event_time: float) -> None:
        if len(members) < self.config.min_workers:
            lost = [self.members[m].describe() for m in self.current if m not in members]
            self._fail(f"only {len(members)} worker(s) left, fewer than --min-workers {self.config.min_workers}"
                       + (f" (lost: {', '.join(lost)})" if lost else ""), members)
            return
        previous = self.current
        generation = self.generation + 1
        lost = [m for m in previous if m not in members]
        joined = [m for m in members if m not in previous] if generation > 0 else []
        payload = {"status": "ok", "generation": generation, "members": members, "lost": lost, "joined": joined,
                   "reason": reason, "event_time": event_time}
        for member_id in members:
            self._answer(self.requests.pop(member_id), payload)
        self.generation, self.current = generation, list(members)
        self._formation, self._signalled = None, False
        if generation == 0:
            self.log(f"phalanx run: elastic job formed with {len(members)} worker(s).")
        else:
            change = [f"lost {', '.join(self.members[m].describe() for m in lost)}" if lost else "",
                      f"joined {', '.join(self.members[m].describe() for m in joined)}" if joined else ""]
            self.log(f"phalanx run: elastic generation {generation}: {len(members)} worker(s) "
                     f"({'; '.join(c for c in change if c) or reason}).")

    def _fail(self, message: str, members: list[int]) -> None:
        """End the job; the first survivor holding trained state is asked to save a checkpoint."""
        self.status = f"failed: {message}"
        self.store.set(Keys.STATUS, self.secret.seal(Keys.STATUS, self.status))
        self.log(f"phalanx run: error: the elastic job stops: {message}.")
        survivors = [m for m in members if m in self.current]
        for member_id in members:
            request = self.requests.pop(member_id, None)
            if request is not None:
                save = bool(survivors) and member_id == survivors[0]
                self._answer(request, {"status": "below-min", "message": message, "save": save})
        for request in list(self.requests.values()):
            self._answer_closed(request)

    def _answer_closed(self, request: _Request) -> None:
        if self.status == "finished":
            self._answer(request, {"status": "finished", "message": "the job finished before this worker joined."})
        else:
            self._answer(request, {"status": "below-min", "message": (self.status or "closed").removeprefix("failed: "),
                                   "save": False})

    def _answer(self, request: _Request, payload: dict[str, Any]) -> None:
        self.requests.pop(request.member, None)
        key = Keys.answer(request.member, request.seq)
        self.store.set(key, self.secret.seal(key, json.dumps(payload)))

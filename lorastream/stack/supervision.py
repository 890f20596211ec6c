"""The child processes of `lorastream up`, and a worker restarted when it dies.

A worker that exits while the stack runs is started again with the same command, after a delay
that doubles with each restart (``backoff_s``, ``2·backoff_s``, … up to ``max_backoff_s``), as
Docker's restart policy does; compose's ``max_attempts`` and ``window`` bound it: after
``max_restarts`` restarts within ``window_s`` the worker is left down and the stack stops, so a
worker that can never start does not loop for ever. Meanwhile the store and the gateway keep
serving: the gateway marks the worker down, sends new requests to the others (or answers 503 when
none is left) and takes the worker back once its health check answers SERVING again. Any other part
(the store, the gateway) that dies still stops the stack.

Example, with the defaults (5 restarts in 600 s, 1 s doubling to 30 s): a worker killed at t=0 is
restarted at t=1; killed again right away, at t≈3 (2 s); then 4 s, 8 s, 16 s later; a sixth exit
within the 600 s stops the stack. A restart older than 600 s no longer counts, nor raises the delay.
"""

from __future__ import annotations

import enum
import logging
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestartPolicy:
    """How `lorastream up` restarts a worker that died (the flags ``--worker-restart-*``)."""

    max_restarts: int = 5  # restarts within window_s before the stack gives up; 0: never restart
    window_s: float = 600.0  # a restart older than this no longer counts
    backoff_s: float = 1.0  # delay before the first restart; doubles with each counted one
    max_backoff_s: float = 30.0  # the delay's bound

    def delay(self, recent: int) -> float:
        """The delay before a restart when ``recent`` restarts are within the window."""
        return min(self.backoff_s * 2.0 ** recent, self.max_backoff_s)


class RestartHistory:
    """When a part was restarted, as far back as the policy's window."""

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._times: deque[float] = deque()

    def recent(self, now: float) -> int:
        """Restarts within the window that ends at ``now``."""
        while self._times and now - self._times[0] >= self._window_s:
            self._times.popleft()
        return len(self._times)

    def record(self, now: float) -> None:
        self._times.append(now)


class Happened(enum.Enum):
    """What the supervisor saw or did, in the order of :attr:`Supervisor.events`."""

    EXITED = "exited"
    RESTART_SCHEDULED = "restart scheduled"
    RESTARTED = "restarted"
    GAVE_UP = "gave up"


@dataclass(frozen=True)
class Event:
    part: str
    what: Happened
    # EXITED: the exit status; RESTART_SCHEDULED: the delay (s); RESTARTED: the new pid;
    # GAVE_UP: the restarts counted within the window
    detail: float | int | None = None


@dataclass
class Part:
    """One child process and the command that starts it again."""

    name: str
    command: list[str]
    env: dict[str, str]
    restartable: bool
    process: subprocess.Popen[bytes]
    history: RestartHistory
    due: float | None = None  # when a scheduled restart starts it again; None: none scheduled


class Supervisor:
    """Starts the stack's parts, restarts a dead restartable one under :class:`RestartPolicy`,
    and stops them all; :attr:`events` records what it saw and did (the log says the same)."""

    def __init__(self, policy: RestartPolicy | None = None, tick_s: float = 0.5) -> None:
        self.policy = policy or RestartPolicy()
        self.tick_s = tick_s  # how often the processes are checked
        self.parts: list[Part] = []  # in start order
        self.events: list[Event] = []
        self._lock = threading.RLock()
        self._stopped = False  # stop_all began: nothing is started again

    def spawn(self, name: str, command: Sequence[str], env: dict[str, str],
              restartable: bool = False) -> subprocess.Popen[bytes]:
        """Start ``command``, in a process group of its own: a Ctrl-C in the terminal reaches
        only the supervisor, which stops the parts one by one with one signal each (a second one
        would cut their drain)."""
        part = Part(name, list(command), env, restartable, _start(command, env),
                    RestartHistory(self.policy.window_s))
        with self._lock:
            self.parts.append(part)
        return part.process

    def run(self, stop: threading.Event) -> str | None:
        """Supervise until ``stop`` is set (None) or the stack must stop: why, as a sentence."""
        while not stop.wait(self._next_wait()):
            why = self.check()
            if why is not None:
                return why
        return None

    def check(self, now: float | None = None) -> str | None:
        """One look at every part: note exits, schedule and make due restarts. Returns why the
        stack must stop (a part that is not restarted died), else None."""
        now = time.monotonic() if now is None else now
        with self._lock:  # stop_all waits for a restart under way, and none follows it
            return None if self._stopped else self._check(now)

    def _check(self, now: float) -> str | None:
        for part in self.parts:
            if part.due is not None:
                if now >= part.due:
                    self._restart(part, now)
                continue
            status = part.process.poll()
            if status is None:
                continue
            self._note(Event(part.name, Happened.EXITED, status))
            if not part.restartable:
                log.error("%s exited with status %s; stopping the stack", part.name, status)
                return f"{part.name} exited with status {status}"
            recent = part.history.recent(now)
            if recent >= self.policy.max_restarts:
                self._note(Event(part.name, Happened.GAVE_UP, recent))
                log.error("%s exited with status %s after %d restarts within %.0f s "
                          "(--worker-restarts, --worker-restart-window); stopping the stack",
                          part.name, status, recent, self.policy.window_s)
                return (f"{part.name} exited with status {status} after {recent} restarts "
                        f"within {self.policy.window_s:.0f} s")
            delay = self.policy.delay(recent)
            part.due = now + delay
            self._note(Event(part.name, Happened.RESTART_SCHEDULED, delay))
            log.error("%s exited with status %s; restarting it in %.1f s (restart %d of at "
                      "most %d within %.0f s); the gateway routes around it meanwhile",
                      part.name, status, delay, recent + 1, self.policy.max_restarts,
                      self.policy.window_s)
        return None

    def stop_all(self, grace_s: float) -> None:
        """SIGINT each running part, last started first (each drains for up to its drain
        period), killing one still running after ``grace_s``; a scheduled restart is dropped."""
        with self._lock:
            self._stopped = True
            parts = list(reversed(self.parts))
        for part in parts:
            part.due = None
            if part.process.poll() is not None:
                continue
            part.process.send_signal(signal.SIGINT)
            try:
                part.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0f s; killing it", part.name, grace_s)
                part.process.kill()
                part.process.wait()

    def _restart(self, part: Part, now: float) -> None:
        part.due = None
        part.history.record(now)
        part.process = _start(part.command, part.env)
        self._note(Event(part.name, Happened.RESTARTED, part.process.pid))
        log.warning("%s restarted (pid %d); the gateway takes it back once it serves",
                    part.name, part.process.pid)

    def _next_wait(self) -> float:
        now = time.monotonic()
        dues = [part.due - now for part in self.parts if part.due is not None]
        return max(0.0, min([self.tick_s, *dues]))

    def _note(self, event: Event) -> None:
        with self._lock:
            self.events.append(event)


def _start(command: Sequence[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(list(command), env=env, process_group=0)

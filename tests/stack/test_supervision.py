"""`lorastream up` restarts a worker that dies, with a doubling delay bounded by its restart
policy, and keeps the gateway and the store serving meanwhile: first the supervisor with real
child processes, then a real stack (store, worker, gateway as processes) whose worker is killed."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from lorastream.cli.main import app
from lorastream.core.store_client import StoreClient
from lorastream.core.worker_client import WorkerClient
from lorastream.stack.launcher import Stack, StackConfig
from lorastream.stack.supervision import Event, Happened, RestartPolicy, Supervisor
from tests.support.models import make_peft_adapter, make_tiny_checkpoint
from tests.support.ports import free_ports


def _exits(status: int, starts: Path) -> list[str]:
    """A child that notes its start in ``starts``, then exits with ``status``."""
    code = f"open({str(starts)!r}, 'a').write('started\\n'); raise SystemExit({status})"
    return [sys.executable, "-c", code]


def _kinds(events: list[Event]) -> list[Happened]:
    return [e.what for e in events]


def test_a_dying_worker_is_restarted_with_a_doubling_bounded_delay_then_given_up(
    tmp_path: Path,
) -> None:
    starts = tmp_path / "starts"
    policy = RestartPolicy(max_restarts=3, window_s=3600, backoff_s=0.01, max_backoff_s=0.03)
    supervisor = Supervisor(policy, tick_s=0.01)
    supervisor.spawn("worker 0", _exits(3, starts), dict(os.environ), restartable=True)

    why = supervisor.run(threading.Event())

    assert why == "worker 0 exited with status 3 after 3 restarts within 3600 s"
    assert starts.read_text().splitlines() == ["started"] * 4  # the first start, 3 restarts
    restart = [Happened.EXITED, Happened.RESTART_SCHEDULED, Happened.RESTARTED]
    assert _kinds(supervisor.events) == restart * 3 + [Happened.EXITED, Happened.GAVE_UP]
    delays = [e.detail for e in supervisor.events if e.what is Happened.RESTART_SCHEDULED]
    assert delays == [0.01, 0.02, 0.03]  # 0.04 bounded by max_backoff_s
    assert {e.detail for e in supervisor.events if e.what is Happened.EXITED} == {3}


@pytest.mark.parametrize(("window_s", "second_delay"), [(1000.0, 0.02), (50.0, 0.01)])
def test_a_restart_older_than_the_window_no_longer_counts(
    tmp_path: Path, window_s: float, second_delay: float
) -> None:
    """Times are given to check(): the first restart at t=1, the second exit seen at t=100."""
    policy = RestartPolicy(max_restarts=1, window_s=window_s, backoff_s=0.01, max_backoff_s=1)
    supervisor = Supervisor(policy)
    process = supervisor.spawn("worker 0", _exits(1, tmp_path / "starts"), dict(os.environ),
                               restartable=True)
    process.wait()
    assert supervisor.check(now=0.0) is None  # exited: restart scheduled for t=0.01
    assert supervisor.check(now=1.0) is None  # restarted
    supervisor.parts[0].process.wait()
    why = supervisor.check(now=100.0)
    if window_s > 100:  # the restart at t=1 counts: max_restarts=1 is reached
        assert why is not None and "after 1 restarts within 1000 s" in why
        assert supervisor.events[-1] == Event("worker 0", Happened.GAVE_UP, 1)
    else:
        assert why is None
        assert supervisor.events[-1] == Event("worker 0", Happened.RESTART_SCHEDULED,
                                              second_delay)


@pytest.mark.parametrize(("name", "restartable", "max_restarts"),
                         [("gateway", False, 5), ("worker 0", True, 0)])
def test_a_part_that_is_not_restarted_stops_the_stack_at_its_first_exit(
    tmp_path: Path, name: str, restartable: bool, max_restarts: int
) -> None:
    supervisor = Supervisor(RestartPolicy(max_restarts=max_restarts), tick_s=0.01)
    supervisor.spawn(name, _exits(1, tmp_path / "starts"), dict(os.environ), restartable)
    why = supervisor.run(threading.Event())
    assert why is not None and why.startswith(f"{name} exited with status 1")
    assert Happened.RESTARTED not in _kinds(supervisor.events)
    assert (tmp_path / "starts").read_text().count("started") == 1


def test_stopping_drops_a_scheduled_restart(tmp_path: Path) -> None:
    supervisor = Supervisor(RestartPolicy(backoff_s=0.01), tick_s=0.01)
    process = supervisor.spawn("worker 0", _exits(1, tmp_path / "starts"), dict(os.environ),
                               restartable=True)
    process.wait()
    assert supervisor.check(now=0.0) is None  # restart scheduled for t=0.01
    supervisor.stop_all(grace_s=5)
    assert supervisor.check(now=1.0) is None
    assert _kinds(supervisor.events) == [Happened.EXITED, Happened.RESTART_SCHEDULED]


def test_up_declares_the_restart_policy_flags_with_its_defaults() -> None:
    result = CliRunner().invoke(app, ["up", "--help"], terminal_width=200)
    text = " ".join(result.output.split())
    defaults = RestartPolicy()
    for flag, default in [("--worker-restarts", defaults.max_restarts),
                          ("--worker-restart-window", defaults.window_s),
                          ("--worker-restart-delay", defaults.backoff_s),
                          ("--worker-restart-max-delay", defaults.max_backoff_s)]:
        assert f"{flag} " in text and f"[default: {default};" in text, flag


def test_a_killed_worker_under_up_is_restarted_while_gateway_and_store_keep_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the parts' caches, not the user's
    monkeypatch.delenv("LORASTREAM_WORKER_INSECURE_NO_AUTH")  # as up sets it: see below
    model = make_tiny_checkpoint(tmp_path / "model")
    adapter = make_peft_adapter(model, tmp_path / "adapter", rank=4, targets=["q_proj"])
    store_port, worker_port, gateway_port, metrics_port = free_ports(4)
    policy = RestartPolicy(max_restarts=2, window_s=3600, backoff_s=0.5, max_backoff_s=1)
    stack = Stack(StackConfig(
        model=str(model), store_port=store_port, worker_port=worker_port,
        gateway_port=gateway_port, metrics_port=metrics_port, insecure_no_auth=True,
        log_level="WARNING", drain_seconds=0.5, restart=policy,
    ))
    request = {"model": str(model), "prompt": "Hi", "max_tokens": 2}
    supervising = threading.Thread(target=stack.supervise)
    try:
        stack.start()
        supervising.start()
        http = httpx.Client(base_url=stack.gateway, timeout=60)
        assert http.post("/v1/completions", json=request).status_code == 200
        (worker,) = [p for name, p in stack.processes if name == "worker 0"]

        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
        # meanwhile: a clean 503 from the gateway (not a transport error), the store answers
        refused = http.post("/v1/completions", json=request)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["type"] == "service_unavailable", refused.text
        with StoreClient(stack.store) as store:
            assert store.list()[0] == []  # it answers (nothing is registered)

        def served() -> bool:
            return http.post("/v1/completions", json=request).status_code == 200

        while not served():  # the gateway takes the restarted worker back
            assert supervising.is_alive(), stack.supervisor.events
            threading.Event().wait(0.2)
        (restarted,) = [p for name, p in stack.processes if name == "worker 0"]
        assert restarted.pid != worker.pid and restarted.poll() is None
        # up --insecure-no-auth opened its worker to anonymous loads, the restarted one too
        with WorkerClient(stack.workers[0]) as anyone:
            assert anyone.load_adapter("mine", local_path=str(adapter)).name == "mine"
        assert _kinds(stack.supervisor.events) == [
            Happened.EXITED, Happened.RESTART_SCHEDULED, Happened.RESTARTED]
        assert stack.supervisor.events[0].detail == -signal.SIGKILL
        http.close()
    finally:
        stack.stop()
        supervising.join()
    assert all(p.poll() is not None for _, p in stack.processes)

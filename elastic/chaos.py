"""Chaos: faults at random, from a seed, on a running local slice.

A chaos spec is comma-separated `key=value`: `mtbf=60` (mean seconds between
faults; the gaps are exponential), `seed=1`, `kinds=kill-worker+preempt` (or
`all`, the default), `count=N` (stop after N faults; default unlimited),
`host-down=S` (seconds a killed host stays down; default: a reboot).

Fault kinds (each journaled as `fault_injected`):

- kill-worker: SIGKILL a host's worker process group;
- kill-host: SIGKILL its agent and worker; the host comes back (a new agent)
  after heartbeat_timeout_s + 2 s, as a rebooted machine would, or after
  `host-down=S` seconds of the chaos spec (a repair: `host-down=600`);
- stop-worker: SIGSTOP the worker (a hang: the controller must SIGKILL it);
- stop-agent: SIGSTOP the agent, SIGCONT after heartbeat_timeout_s + 2 s (its
  worker trains on; see health.carry_silent_hosts);
- preempt: SIGTERM to the agent (emergency checkpoint, the host leaves); the
  host comes back after its agent exits;
- kill-during-save: SIGKILL a worker right after a checkpoint save starts
  (the async write is in flight);
- lose-device: take one device node away from a host (elastic.simdevices: a
  chip that failed; its agent reports fewer devices at its next heartbeat)
  and give it back after REPAIR_S (repaired); skipped on a host with one
  device left;
- partition: cut a host off the network, both ways, for PARTITION_S;
- partition-controller: the host still reaches its peers (and the bucket)
  but not the controller, for PARTITION_S;
- partition-peers: it reaches the controller (and the bucket) but not its
  peers: its collectives hang, for PARTITION_S;
- slow-link: the host's link throttled to SLOW_LINK_KBIT kbit/s both ways,
  for SLOW_LINK_S (must cause no false host loss).
The network kinds need isolated hosts (`elasticd local --isolate`,
elastic.local.network); elsewhere they are skipped with a journaled message
(`fault_skipped`). Their end is journaled as `fault_healed`;
- kill-controller: SIGKILL the controller; it starts again at the same
  address after CONTROLLER_RESTART_S, as systemd restarts it, and adopts the
  running slice (with a standby, `elasticd local --standby`, the standby
  takes over at once and the killed one comes back as the standby) (the
  HOST is not used; needs the launcher that owns the controller: `elasticd
  local`, not `elasticd chaos`);
- stop-controller: SIGSTOP the controller for away_s (heartbeat timeout
  + 2 s), then SIGCONT: a controller starved or suspended that long must
  not take its own pause for the hosts' silence (journaled as
  `controller_paused`); agents look for another controller meanwhile;
- storage-slow: STORAGE_SLOW_LATENCY_S added to every request to the
  checkpoint bucket for STORAGE_FAULT_S (a bucket in a farther region);
- storage-outage: every request to the bucket answered 503 for
  STORAGE_FAULT_S.
The storage kinds act on the whole bucket, whatever host is named (the
HOST of `--fault storage-outage:all@t=30` is not used), through the
storage proxy of `elasticd local --gcs-emulator`
(elastic.checkpoint.faulty_storage); without one they are skipped with a
journaled message. Their end is journaled as `fault_healed`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import pathlib
import random
import signal
import threading
import time
from collections.abc import Callable

import grpc

from elastic import simdevices
from elastic.clock import Clock, SystemClock
from elastic.controller.journal import JournalTail, JournalWriter
from elastic.controller.status import fetch_status, slice_step
from elastic.faults import Fault
from elastic.procs import alive, signal_group, signal_pid
from elastic.security.tls import TLSFiles

log = logging.getLogger("elastic.chaos")

#: Seconds until a device taken by `lose-device` comes back: long enough that
#: the slice has restarted without it, as a repair would take far longer.
REPAIR_S = 20.0

#: Storage faults: the round trip storage-slow adds (a bucket in another
#: region; the emergency checkpoint must still commit within GCE's 30 s
#: notice through it) and how long each storage fault lasts.
STORAGE_SLOW_LATENCY_S = 0.1
STORAGE_FAULT_S = 60.0

#: Network faults: how long a partition lasts (longer than any heartbeat
#: timeout here, so the host is declared lost and comes back), and the rate
#: and length of a throttled link (1 Mbit/s: heartbeats and reports fit
#: easily, a collective of the reference jobs' size is slowed many times).
PARTITION_S = 12.0
SLOW_LINK_KBIT = 1000
SLOW_LINK_S = 30.0

#: Seconds from a kill of the controller to its new start (the shipped
#: unit's RestartSec=2, workers/systemd/elasticd.service).
CONTROLLER_RESTART_S = 2.0

STORAGE_KINDS = ("storage-slow", "storage-outage")
#: Kinds that act on the whole job; the HOST of a planned one is not used.
JOB_KINDS = (*STORAGE_KINDS, "kill-controller", "stop-controller")
NETWORK_KINDS = ("partition", "partition-controller", "partition-peers", "slow-link")
CHAOS_KINDS = ("kill-worker", "kill-host", "stop-worker", "stop-agent", "preempt",
               "kill-during-save", "lose-device", *NETWORK_KINDS, *STORAGE_KINDS,
               "kill-controller", "stop-controller")


@dataclasses.dataclass(frozen=True)
class ChaosSpec:
    """mtbf_s: mean seconds between faults; seed; kinds drawn from; count:
    the number of faults (None: until stopped); host_down_s: seconds a
    killed host stays down (None: heartbeat timeout + 2 s, a reboot)."""

    mtbf_s: float = 60.0
    seed: int = 0
    kinds: tuple[str, ...] = CHAOS_KINDS
    count: int | None = None
    host_down_s: float | None = None


def parse_chaos(text: str) -> ChaosSpec:
    """Parse `mtbf=60,seed=1,kinds=kill-worker+preempt,count=5`. Raises
    ValueError naming the bad part."""
    values: dict = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        try:
            if key == "mtbf" and eq:
                values["mtbf_s"] = float(value.rstrip("s"))
            elif key == "seed" and eq:
                values["seed"] = int(value)
            elif key == "count" and eq:
                values["count"] = int(value)
            elif key == "host-down" and eq:
                values["host_down_s"] = float(value.rstrip("s"))
            elif key == "kinds" and eq:
                kinds = CHAOS_KINDS if value == "all" else tuple(value.split("+"))
                unknown = [k for k in kinds if k not in CHAOS_KINDS]
                if unknown:
                    raise ValueError(f"unknown fault kind(s) {unknown}")
                values["kinds"] = kinds
            else:
                raise ValueError("expected mtbf=S, seed=N, kinds=A+B, count=N or host-down=S")
        except ValueError as e:
            raise ValueError(f"chaos spec {text!r}: {part!r}: {e}") from None
    spec = ChaosSpec(**values)
    if not (math.isfinite(spec.mtbf_s) and spec.mtbf_s > 0) or \
            (spec.count is not None and spec.count < 1) or \
            (spec.host_down_s is not None and not (math.isfinite(spec.host_down_s)
                                                   and spec.host_down_s >= 0)):
        raise ValueError(f"chaos spec {text!r}: mtbf must be a finite number > 0, "
                         f"count >= 1 and host-down a finite number >= 0")
    return spec


def schedule(spec: ChaosSpec, n: int) -> list[tuple[float, str, float]]:
    """The first `n` faults of `spec`: (seconds after the previous fault,
    kind, a number in [0, 1) that picks the host). Pure: the same seed gives
    the same faults."""
    rng = random.Random(spec.seed)
    return [(rng.expovariate(1.0 / spec.mtbf_s), rng.choice(spec.kinds), rng.random())
            for _ in range(n)]


def faults_scheduled(spec: ChaosSpec, duration_s: float) -> int:
    """How many of `spec`'s faults (at most `spec.count`) are due within
    `duration_s` seconds of the start, on the one timeline Chaos keeps: what
    a run of that length should deliver. Pure."""
    due, n = 0.0, 0
    for gap, _, _ in schedule(spec, spec.count if spec.count is not None else 100_000):
        due += gap
        if due >= duration_s:
            break
        n += 1
    return n


class Chaos(threading.Thread):
    """Injects faults into the slice whose controller is at `address`
    (status read with the operator bundle `tls`), journaling into
    `state_dir`: at random from `spec`, and the `planned` ones when their
    triggers come.

    restart_agent(host_id): start that host's agent again (the caller owns
    the process); returning False means not yet (the old process is still
    being torn down), and it is asked again every 0.5 s.
    keep_running: keep serving the come-back actions of faults injected
    from outside (inject()) until stop().
    heartbeat_timeout_s: how long a host must stay away to be declared lost
    (stopped agents resume, killed hosts come back after it + 2 s).
    storage: the proxy between the slice and its checkpoint bucket
    (elastic.checkpoint.faulty_storage.FaultProxy) for the storage kinds.
    network: the isolated hosts' network (elastic.local.network.NetworkPlan)
    for the network kinds. controller: (kill, restart) of the controller
    for kill-controller (kill returns the pid it killed and what happens
    next, for the journal). clock: for the random faults' timeline.

    The random faults come at their own times on one timeline from the
    start (a fault comes whether or not the slice has recovered from the
    last one), each once the slice runs. A kill-during-save waits for the
    next save in a thread of its own, and the faults due meanwhile come at
    their times (it then kills the worker its host runs by then); before,
    they all came at once when it was done, and one restart took them all.
    Two kill-during-saves due within one save interval take one save each.
    `injected` counts the faults made; `error` is the exception that ended
    the injector early, or None (logged too: an injector that died
    silently would leave the rest of a benchmark's run without faults).
    """

    def __init__(self, spec: ChaosSpec | None, address: str, tls: TLSFiles | None,
                 state_dir, restart_agent:
                 Callable[[str], None], agent_pid: Callable[[str], int],
                 heartbeat_timeout_s: float, planned: list[Fault] | None = None,
                 keep_running: bool = False, storage=None, network=None,
                 controller: tuple[Callable[[], tuple[int, str]], Callable[[], None]] | None = None,
                 clock: Clock | None = None) -> None:
        super().__init__(daemon=True)
        self.clock = clock or SystemClock()
        self.error: Exception | None = None
        self.storage, self.network, self.controller = storage, network, controller
        self.keep_running = keep_running
        self.spec, self.address, self.tls, self.state_dir = spec, address, tls, state_dir
        self.planned = list(planned or [])
        self.restart_agent, self.agent_pid = restart_agent, agent_pid
        self.away_s = heartbeat_timeout_s + 2.0
        # how long a killed host stays down
        self.host_down_s = spec.host_down_s if spec and spec.host_down_s is not None \
            else self.away_s
        self.journal = JournalWriter(state_dir)
        self.injected = 0
        self._halt = threading.Event()
        self._lock = threading.Lock()  # inject() may be called from another thread
        # one kill-during-save waits at a time: each takes a save of its own
        self._save_kill = threading.Lock()
        self._pending: list[tuple[float, Callable[[], None]]] = []

    def _status(self):
        """The job's status from the first controller address that answers
        (`address` may list a leader and its standby, comma-separated).
        Raises grpc.RpcError when none does."""
        addresses = self.address.split(",")
        for i, address in enumerate(addresses):
            try:
                return fetch_status(address, self.tls, timeout_s=2.0)
            except grpc.RpcError:
                if i == len(addresses) - 1:
                    raise

    def check(self) -> None:
        """Raise RuntimeError, naming `error` and the faults made before it,
        when the injector failed (its run had fewer faults than scheduled:
        a benchmark's figure from it is void); else nothing."""
        if self.error is not None:
            raise RuntimeError(f"the fault injector failed after {self.injected} faults "
                               f"({self.error!r}): the run is void, {self.state_dir}")

    def stop(self) -> None:
        """Stop injecting; resume stopped agents and bring back hosts due back."""
        self._halt.set()
        if self.ident is not None:  # started
            self.join(5.0)
        for _, action in self._pending:
            action()
        self._pending.clear()
        self.journal.close()

    def _later(self, delay_s: float, action: Callable[[], None]) -> None:
        with self._lock:
            self._pending.append((self.clock.monotonic() + delay_s, action))

    def _run_due(self) -> None:
        now = self.clock.monotonic()
        with self._lock:
            due = [p for p in self._pending if p[0] <= now]
            self._pending = [p for p in self._pending if p[0] > now]
        for _, action in due:
            action()

    def _wait(self, seconds: float) -> bool:
        """Sleep `seconds` (none if not positive) while running due
        actions; False when stopped."""
        deadline = self.clock.monotonic() + seconds
        while self.clock.monotonic() < deadline:
            self._run_due()
            if self._halt.wait(min(0.1, max(0.0, deadline - self.clock.monotonic()))):
                return False
        return not self._halt.is_set()

    def _running_status(self):
        """The status once the slice runs (and has stepped); None when stopped."""
        while not self._halt.is_set():
            self._run_due()
            try:
                st = self._status()
                if st.phase == "running" and slice_step(st) >= 0:
                    return st
            except grpc.RpcError:
                pass
            self._halt.wait(0.2)
        return None

    def run(self) -> None:
        try:
            if self.planned:
                self._run_planned()
            if self.spec is not None:
                self._run_random()
        except Exception as e:  # noqa: BLE001 - kept and said: no more faults come
            self.error = e
            log.exception("the fault injector failed after %d faults; no more are injected",
                          self.injected)
        # bring back what is due back (and, with keep_running, serve faults
        # injected from outside through inject())
        while (self._pending or self.keep_running) and not self._halt.is_set():
            self._wait(0.2)

    def _run_planned(self) -> None:
        t0 = self.clock.monotonic()
        order = list(self.planned)  # an after= trigger is armed once those before it fired
        tail = JournalTail(self.state_dir, from_end=True)
        journaled: set[str] = set()  # kinds written since the last planned injection
        while self.planned and self._wait(0.1):
            journaled.update(e["kind"] for e in tail.new())
            try:
                status = self._status()
            except grpc.RpcError:
                continue
            step = slice_step(status)
            for fault in list(self.planned):
                armed = fault.after is None or all(f not in self.planned
                                                   for f in order[:order.index(fault)])
                elapsed_s = self.clock.monotonic() - t0
                if not armed or not fault.due(step, elapsed_s, frozenset(journaled)):
                    continue
                host = next((h for h in status.hosts if h.host_id == fault.host
                             or (fault.kind in JOB_KINDS and h.state == "member")
                             or fault.kind == "kill-controller"), None)
                if host is not None:
                    self.planned.remove(fault)
                    self.inject(fault.kind, host, status)
                    self.injected += 1
                    journaled = set(e["kind"] for e in tail.new() if e["kind"] != "fault_injected")
                    break  # the status is stale after a fault

    def _run_random(self) -> None:
        n = self.spec.count if self.spec.count is not None else 100_000
        t0, due = self.clock.monotonic(), 0.0
        for gap, kind, pick in schedule(self.spec, n):
            due += gap  # (seconds from the start: see the class's docstring)
            if not self._wait(t0 + due - self.clock.monotonic()):
                return
            status = self._running_status()
            if status is None:
                return
            members = sorted((h for h in status.hosts if h.state == "member"),
                             key=lambda h: h.host_id)
            host = members[int(pick * len(members))]
            if kind == "kill-during-save":  # (it waits for a save: the timeline goes on)
                self._in_background(kind, lambda host=host, status=status:
                                    self.inject("kill-during-save", host, status))
            else:
                self.inject(kind, host, status)
            self.injected += 1

    def _in_background(self, name: str, action: Callable[[], None]) -> None:
        """Run `action` in a daemon thread of its own; an exception it
        raises is kept in `error`, as the injector's own would be."""
        def run() -> None:
            try:
                action()
            except Exception as e:  # noqa: BLE001 - kept and said
                self.error = self.error or e
                log.exception("the fault injector's %s failed", name)

        threading.Thread(target=run, name=f"chaos-{name}", daemon=True).start()

    def _record(self, kind: str, host, status, pids: list[int], note: str = "",
                at: float | None = None) -> None:
        """Journal a fault made at `at` (wall-clock seconds; default now, for
        a fault journaled before it is made)."""
        self.journal.write(time.time() if at is None else at, "fault_injected", status.generation,
                           f"chaos: {kind} {host.host_id} (slice at step {slice_step(status)})"
                           + (f"; {note}" if note else ""), host.host_id,
                           {"fault": kind, "step": slice_step(status), "pids": pids})

    def inject(self, kind: str, host, status) -> None:
        """Perform one fault of `kind` on `host` (a HostStatus of `status`) now."""
        h, worker, agent = host.host_id, host.worker_pid, host.agent_pid
        if kind in STORAGE_KINDS:
            self._storage_fault(kind, status)
            return
        if kind in NETWORK_KINDS:
            self._network_fault(kind, host, status)
            return
        if kind == "kill-controller":
            self._kill_controller(status)
            return
        if kind == "stop-controller":
            self._stop_controller(status)
            return
        if kind == "kill-during-save":
            with self._save_kill:  # (two due within one save interval: one save each)
                since = time.time()
                saved = self._wait_for_save(since, timeout_s=120)
                if self._halt.is_set():
                    return  # (stopped while it waited: nothing is killed)
                try:
                    status = self._status()
                except grpc.RpcError:
                    pass  # (the status of before the wait: the worker's pid is the same)
                host = next((x for x in status.hosts if x.host_id == h), host)
                worker = host.worker_pid
                note = (f"save of step {saved['step']} in flight" if saved
                        else "no save came; killed")
                self._record(kind, host, status, [worker], note)
                signal_group(worker, signal.SIGKILL)
            return
        # (each fault is journaled before it is made: what it sets off, a
        # preemption_notice say, comes after it in the journal)
        if kind == "kill-worker":
            self._record(kind, host, status, [worker])
            signal_group(worker, signal.SIGKILL)
        elif kind == "stop-worker":
            self._record(kind, host, status, [worker])
            signal_pid(worker, signal.SIGSTOP)
        elif kind == "kill-host":
            self._record(kind, host, status, [agent, worker])
            signal_pid(agent, signal.SIGKILL)
            signal_group(worker, signal.SIGKILL)
            self._later(self.host_down_s, lambda: self._restart_agent(h))
        elif kind == "stop-agent":
            self._record(kind, host, status, [agent])
            signal_pid(agent, signal.SIGSTOP)
            self._later(self.away_s, lambda: signal_pid(agent, signal.SIGCONT))
        elif kind == "lose-device":
            path = simdevices.device_dir(pathlib.Path(self.state_dir), h)
            name = simdevices.remove_device(path)
            if name is None:
                self.journal.write(time.time(), "fault_skipped", status.generation,
                                   "lose-device: the host has one device left", h,
                                   {"fault": kind})
                return
            self._record(kind, host, status, [], f"device {name} removed")
            self._later(REPAIR_S, lambda: simdevices.restore_device(path, name))
        elif kind == "preempt":
            self._record(kind, host, status, [agent])
            signal_pid(agent, signal.SIGTERM)
            self._later(1.0, lambda: self._come_back_after_exit(h, agent))

    def _kill_controller(self, status) -> None:
        """SIGKILL the controller; start it again after CONTROLLER_RESTART_S."""
        step = slice_step(status)
        if self.controller is None:
            self.journal.write(time.time(), "fault_skipped", status.generation,
                               "kill-controller: only the launcher that owns the controller "
                               "(elasticd local) can start it again; skipped", None,
                               {"fault": "kill-controller"})
            return
        kill, restart = self.controller
        at = time.time()  # (kill() returns once the process is reaped)
        pid, then = kill()
        self.journal.write(at, "fault_injected", status.generation,
                           f"chaos: kill-controller (slice at step {step}); {then}", None,
                           {"fault": "kill-controller", "step": step, "pids": [pid]})
        self._later(CONTROLLER_RESTART_S, restart)

    def _stop_controller(self, status) -> None:
        """SIGSTOP the controller (its pid from local.json); SIGCONT after away_s."""
        from elastic.local.leftovers import LOCAL_FILE  # (elastic.local imports this module)

        try:
            pid = json.loads((pathlib.Path(self.state_dir) / LOCAL_FILE).read_text())[
                "controller_pid"]
        except (OSError, ValueError, KeyError) as e:
            self.journal.write(time.time(), "fault_skipped", status.generation,
                               f"stop-controller: no controller pid in {LOCAL_FILE} ({e})",
                               None, {"fault": "stop-controller"})
            return
        step, at = slice_step(status), time.time()
        signal_pid(pid, signal.SIGSTOP)
        self.journal.write(at, "fault_injected", status.generation,
                           f"chaos: stop-controller (slice at step {step}); SIGCONT in "
                           f"{self.away_s:g} s", None,
                           {"fault": "stop-controller", "step": step, "pids": [pid]})
        self._later(self.away_s, lambda: signal_pid(pid, signal.SIGCONT))

    def _storage_fault(self, kind: str, status) -> None:
        """Slow down or cut off the checkpoint bucket for STORAGE_FAULT_S."""
        step = slice_step(status)
        if self.storage is None:
            self.journal.write(time.time(), "fault_skipped", status.generation,
                               f"{kind}: the checkpoints are not behind a storage proxy "
                               f"(elasticd local --gcs-emulator --fault/--chaos puts one "
                               f"there); skipped", None, {"fault": kind})
            return
        if kind == "storage-slow":
            self.storage.set(latency_s=STORAGE_SLOW_LATENCY_S)
            what = f"{STORAGE_SLOW_LATENCY_S * 1000:g} ms added to every bucket request"
        else:
            self.storage.set(outage_s=STORAGE_FAULT_S)
            what = "every bucket request answered 503"
        self.journal.write(time.time(), "fault_injected", status.generation,
                           f"chaos: {kind} (slice at step {step}): {what} for "
                           f"{STORAGE_FAULT_S:g} s", None,
                           {"fault": kind, "step": step, "pids": [],
                            "duration_s": STORAGE_FAULT_S})

        def heal() -> None:
            self.storage.set()
            self.journal.write(time.time(), "fault_healed", status.generation,
                               f"{kind} over: the bucket answers normally again", None,
                               {"fault": kind})

        self._later(STORAGE_FAULT_S, heal)

    def _network_fault(self, kind: str, host, status) -> None:
        """Partition `host` (wholly, from the controller or from its peers) or
        throttle its link; healed after PARTITION_S or SLOW_LINK_S."""
        from elastic.local import network

        h, net = host.host_id, self.network
        if net is None:
            self.journal.write(time.time(), "fault_skipped", status.generation,
                               f"{kind}: the hosts are not isolated (elasticd local --isolate "
                               f"puts each in a network namespace of its own); skipped", h,
                               {"fault": kind})
            return
        peers = [p for p in net.hosts() if p != h]
        # kind -> (apply(cut: bool), what, seconds until healed)
        faults = {
            "partition": (lambda cut: network.set_link(net, h, not cut),
                          "cut off from every other node", PARTITION_S),
            "partition-controller": (
                lambda cut: network.set_blocked(net, h, [network.CONTROLLER], cut),
                "cut off from the controller (its peers still reach it)", PARTITION_S),
            "partition-peers": (lambda cut: network.set_blocked(net, h, peers, cut),
                                "cut off from its peers (the controller still reaches it)",
                                PARTITION_S),
            "slow-link": (lambda cut: network.set_rate(net, h, SLOW_LINK_KBIT if cut else None),
                          f"link throttled to {SLOW_LINK_KBIT} kbit/s", SLOW_LINK_S),
        }
        apply, what, duration = faults[kind]
        at = time.time()  # (the namespace commands take a while)
        apply(True)
        self._record(kind, host, status, [], f"{what} for {duration:g} s", at)

        def healed() -> None:
            apply(False)
            self.journal.write(time.time(), "fault_healed", status.generation,
                               f"{kind} of {h} over", h, {"fault": kind})

        self._later(duration, healed)

    def _come_back_after_exit(self, host_id: str, pid: int) -> None:
        if alive(pid) and not self._halt.is_set():
            self._later(0.5, lambda: self._come_back_after_exit(host_id, pid))
        elif self.agent_pid(host_id) == pid:
            self._restart_agent(host_id)

    def _restart_agent(self, host_id: str) -> None:
        """Start `host_id`'s agent again, asking again every 0.5 s while its
        old process is not gone yet (a zombie main thread is not a process
        that can be reaped: /proc shows Z while the kernel still ends the
        other threads, which once took over 6 s and lost a host for good)."""
        if self.restart_agent(host_id) is False and not self._halt.is_set():
            self._later(0.5, lambda: self._restart_agent(host_id))

    def _wait_for_save(self, since: float, timeout_s: float) -> dict | None:
        tail = JournalTail(self.state_dir)
        deadline = self.clock.monotonic() + timeout_s
        while self.clock.monotonic() < deadline and not self._halt.is_set():
            for e in tail.read():
                if e["kind"] == "checkpoint_saved" and e["ts"] >= since:
                    return e
            self._halt.wait(0.02)
        return None

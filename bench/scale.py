"""Benchmark: one `elasticd` against 1,000 / 5,000 / 10,000 simulated agents.

Simulated agents are `grpc.aio` clients (many per process, no workers), each
with a connection of its own (with the real agents' channel options, their
keepalive pings too) and, with TLS (the default), a host certificate of its
own from the benchmark's CA: each registers, opens its stream,
heartbeats once a second (with its send time) and answers start/stop
commands as a real agent would (a stop is acknowledged with a worker exit
report at once). `--insecure` runs the same in plaintext, to measure what
mutual TLS costs. For each size:

- controller CPU share over 20 s of steady heartbeats (its process's
  user+system time / wall time; 100 % = one core);
- heartbeat latency p50/p99 (controller receipt - agent send, from status),
  and how long the status call took two ways, one after the other: on the
  probe's connection, open since the start, and on a new connection (as
  `elasticd status` makes), both taken up behind the agents' traffic (a
  call that fails is recorded with its status code; the run goes on);
- detection: one agent goes silent -> `host_lost`, minus the silence start
  (target: within heartbeat_timeout_s + 1 s = 6 s);
- fan-out: `generation_started` -> the last agent received its start, and
  `slice_stopping` -> the last agent received its stop, two ways: when the
  command arrived (the kernel's receive timestamp of its datagram at the
  agent's socket, SIOCGSTAMP; a copy on the stream: when the client read
  it), and when the client processes got to it (they share the two cores
  with the controller, and every simulated agent answers a stop with a
  stream write, so this one measures the clients too); the silenced agent,
  declared lost, is left out of the stop's;
- overload: seconds from the controller's start to the generation's start
  (every agent registered and its stream open; how many streams had sent
  their first message by then), registrations deferred by admission control,
  and hosts declared lost that were never silent (the silenced one aside:
  should be 0; elastic.controller.lag), split by whether their simulated
  agent had in fact sent nothing for the heartbeat timeout (its client
  process behind: the benchmark's doing, not the controller's); datagrams
  the kernel dropped for full buffers, on the machine and on the
  controller's socket.

    .venv/bin/python bench/scale.py --agents 1000 5000 10000 [--insecure]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

from common import add_keep_flag, machine, wait_entry, work_dir, write_result
from scale_agents import client_main

REPO = pathlib.Path(__file__).resolve().parent.parent
CLIENT_PROCESSES = 4
#: How long (seconds) the benchmark's status calls may take: at 10,000
#: agents one was not answered within 30 s (2026-11-26); the time it takes
#: is a figure of its own.
STATUS_TIMEOUT_S = 180.0
#: The job's heartbeat timeout (seconds).
HEARTBEAT_TIMEOUT_S = 5.0
# --- the benchmark driver ------------------------------------------------------------------

class IntakeProbe:
    """How long a new call waits before the controller answers it, once a
    second, from the benchmark's driver (a process of its own): a
    grpc.health.v1 Check on one connection, each call started whether or not
    the one before was answered, so a stall of gRPC's intake shows as a run
    of slow answers rather than one. `samples`: (start, seconds to answer,
    or the status code's name if it failed: CANCELLED for calls still
    waiting at close), wall-clock starts."""

    EVERY_S = 1.0

    def __init__(self, address: str, tls) -> None:
        import threading

        from elastic import transport
        self.samples: list[tuple[float, float | str | None]] = []
        self._channel = transport.channel(address, tls)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        check = health_pb2_grpc.HealthStub(self._channel).Check
        while not self._stop.wait(self.EVERY_S):
            started, index = time.time(), len(self.samples)
            self.samples.append((started, None))

            def done(future, started=started, index=index) -> None:
                failed = future.exception()
                self.samples[index] = (started, time.time() - started if failed is None
                                       else failed.code().name)
            check.future(health_pb2.HealthCheckRequest(), timeout=STATUS_TIMEOUT_S
                         ).add_done_callback(done)

    def status_call(self) -> tuple[float | str, object]:
        """A GetStatus on this probe's connection, open since the start:
        (seconds it took or the status code's name, the JobStatus or None)."""
        from elastic.controller.status import status_on
        return timed_status_call(lambda: status_on(self._channel, STATUS_TIMEOUT_S))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._channel.close()

    def summary(self, since: float) -> dict:
        """Median and largest wait (seconds), and the calls that waited over
        2 s or failed: [start - `since`, wait or status code]."""
        answered = sorted(w for _, w in self.samples if isinstance(w, float))
        return {"calls": len(self.samples),
                "p50_s": round(answered[len(answered) // 2], 3) if answered else None,
                "max_s": round(answered[-1], 3) if answered else None,
                "slow": [[round(t - since, 1), round(w, 2) if isinstance(w, float) else w]
                         for t, w in self.samples if not isinstance(w, float) or w > 2.0]}


def timed_status_call(call) -> tuple[float | str, object]:
    """(seconds `call()` took, its result), or (the status code's name,
    None) if it failed with a gRPC error."""
    import grpc
    asked = time.monotonic()
    try:
        status = call()
    except grpc.RpcError as e:
        return e.code().name, None
    return round(time.monotonic() - asked, 3), status


def _ms(seconds: float | None) -> str:
    """Seconds as milliseconds for the table ("-": not measured)."""
    return "-" if seconds is None else f"{1000 * seconds:.1f}ms"


def _last(times: dict, since: float) -> float | None:
    """Seconds from `since` to the latest of `times` (None if empty)."""
    return round(max(times.values()) - since, 3) if times else None


def _by_code(ended: dict) -> dict:
    """{"stage:CODE#client": n} summed over the client processes."""
    total: dict = {}
    for key, n in ended.items():
        code = key.partition("#")[0]
        total[code] = total.get(code, 0) + n
    return total


def udp_receive_buffer_errors() -> int:
    """The kernel's count of UDP datagrams dropped for a full receive buffer
    (all sockets of the machine: /proc/net/snmp, Udp RcvbufErrors)."""
    with open("/proc/net/snmp") as f:
        rows = [line.split() for line in f if line.startswith("Udp:")]
    return int(rows[1][rows[0].index("RcvbufErrors")])


def socket_drops(port: int) -> int | None:
    """Datagrams the kernel dropped on the IPv4 UDP socket bound to `port`
    (the controller's heartbeat socket: the `drops` column of
    /proc/net/udp); None if none is bound to it or the table cannot be
    read."""
    try:
        with open("/proc/net/udp") as f:
            next(f)
            for line in f:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port:
                    return int(fields[-1])
    except (OSError, ValueError, IndexError, StopIteration):
        pass
    return None


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def split_losses(losses: list[dict], send_gaps: dict, timeout_s: float
                 ) -> tuple[list[dict], list[tuple[dict, float]]]:
    """Split `losses` (host_lost journal entries of hosts never silenced)
    by their senders: (those whose simulated agent had handed over no
    heartbeat for at least `timeout_s` seconds up to the entry's time, by
    `send_gaps` ({host: [(last handed, next handed)]}, wall-clock seconds,
    gaps over scale_agents.SEND_GAP_S); [(each other entry, the seconds its
    agent had sent nothing by then: under SEND_GAP_S when no gap spans it)])."""
    unsent, unread = [], []
    for e in losses:
        quiet_s = max((e["ts"] - a for a, b in send_gaps.get(e["host"], ())
                       if a <= e["ts"] <= b), default=0.0)
        if quiet_s >= timeout_s:
            unsent.append(e)
        else:
            unread.append((e, round(quiet_s, 3)))
    return unsent, unread


def run_size(n: int, steady_s: float, insecure: bool, stream_heartbeats: bool = False,
             keep: bool = False) -> dict:
    from elastic.controller.journal import read_journal
    from elastic.controller.status import fetch_status
    from elastic.security import certs
    from elastic.security.identity import Role
    from elastic.security.tls import TLSFiles

    with work_dir(f"elastic-scale-{n}-", keep) as work:
        pki = work / "pki"
        if insecure:
            security, operator, ca_dir = ["--insecure"], None, "-"
        else:
            certs.create_ca(pki)
            security = ["--tls-dir", str(certs.issue(pki, Role.CONTROLLER, "bench").directory)]
            operator = TLSFiles.in_dir(certs.issue(pki, Role.OPERATOR, "bench").directory)
            ca_dir = str(pki)
        spec = work / "job.toml"
        spec.write_text(f"""
[job]
id = "scale"
command = ["true"]
min_hosts = {n}
max_hosts = {n}

[health]
heartbeat_interval_s = 1.0
heartbeat_timeout_s = {HEARTBEAT_TIMEOUT_S}
stop_timeout_s = 30.0
# the silent agent stands for a lost host: its simulated peers keep
# stepping, which would otherwise carry it as a frozen agent
carry_silent_hosts = false
datagram_heartbeats = {"false" if stream_heartbeats else "true"}

[hang]
startup_timeout_s = 600.0
""")
        state = work / "state"
        dropped_before = udp_receive_buffer_errors()
        ctl = subprocess.Popen([sys.executable, "-m", "elastic.cli", "start", "--config", str(spec),
                                "--listen", "127.0.0.1:0", "--state-dir", str(state), *security],
                               stdout=subprocess.DEVNULL, stderr=open(work / "controller.log", "w"))
        clients, address, port, probe = [], "", 0, None
        try:
            deadline = time.monotonic() + 30
            while not (state / "controller.addr").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            address = (state / "controller.addr").read_text().strip()
            port = int(address.rsplit(":", 1)[1])  # (its heartbeat socket's too)
            probe = IntakeProbe(address, operator)
            per = -(-n // CLIENT_PROCESSES)
            for k in range(CLIENT_PROCESSES):
                count = min(per, n - k * per)
                clients.append((subprocess.Popen(
                    [sys.executable, __file__, "client", address, str(k * per), str(count),
                     str(work / f"client{k}.json"), ca_dir],
                    stderr=open(work / f"client{k}.log", "w")),
                    work / f"client{k}.json"))
            started = wait_entry(state, "generation_started", generation=1, timeout_s=600)
            time.sleep(3.0)  # let every start arrive and the heartbeats settle
            c0, t0 = cpu_seconds(ctl.pid), time.monotonic()
            time.sleep(steady_s)
            cpu_share = (cpu_seconds(ctl.pid) - c0) / (time.monotonic() - t0)
            # an operator's call behind the agents' traffic, on an open
            # connection, then on a new one
            status_call_s, status = probe.status_call()
            new_status_call_s, new_status = timed_status_call(
                lambda: fetch_status(address, operator, timeout_s=STATUS_TIMEOUT_S))
            status = status or new_status
            stopped_early = any(e["kind"] == "slice_stopping" and e.get("generation") == 1
                                for e in read_journal(state))
            silent_at = time.time()
            clients[0][0].send_signal(signal.SIGUSR1)  # sim-00000 stops heartbeating
            try:
                lost = wait_entry(state, "host_lost", host="sim-00000", timeout_s=60,
                                  after_ts=silent_at)
            except TimeoutError:  # what the controller sees then, for the reader
                seen = fetch_status(address, operator, timeout_s=STATUS_TIMEOUT_S)
                silent = next((h for h in seen.hosts if h.host_id == "sim-00000"), None)
                print(f"sim-00000 not declared lost 60 s after it went silent: the "
                      f"controller says {silent.state if silent else 'nothing'} of it, last "
                      f"heartbeat {silent.heartbeat_age_s if silent else float('nan'):.1f} s "
                      f"ago ({silent.heartbeat_path if silent else '-'}); heartbeat latency "
                      f"p50 {seen.heartbeat_latency_p50_s:.2f} s, p99 "
                      f"{seen.heartbeat_latency_p99_s:.2f} s; the kernel dropped "
                      f"{socket_drops(port)} datagrams on its "
                      f"socket", flush=True)
                raise
            stopping = wait_entry(state, "slice_stopping", generation=1, timeout_s=60)
            wait_entry(state, "slice_stopped", generation=1, timeout_s=120)
            time.sleep(3.0)  # the last stops arrive
        finally:
            controller_drops = socket_drops(port) if port else None  # (before it closes)
            if probe is not None:
                probe.close()
            for proc, _ in clients:
                proc.send_signal(signal.SIGTERM)
            for proc, _ in clients:
                proc.wait(60)
            ctl.send_signal(signal.SIGTERM)
            ctl.wait(30)
        received: dict = {}
        for _, path in clients:
            for kind, by_host in json.loads(path.read_text()).items():
                received.setdefault(kind, {}).update(by_host)
        starts, stops = received.get("start", {}), received.get("stop", {})
        stops.pop("sim-00000", None)  # the silenced agent: lost, its stop need not arrive
        # when each command arrived: its datagram's kernel timestamp, or its
        # receipt on the stream when that came first or no datagram came
        arrived = {kind: {h: min(t, received.get(f"{kind}_arrived", {}).get(h, t))
                          for h, t in handled.items()}
                   for kind, handled in (("start", starts), ("stop", stops))}
        journal = list(read_journal(state))
        first_ts = journal[0]["ts"]
        per = -(-n // CLIENT_PROCESSES)
        # (the silenced agent too, if it was declared lost before its silence)
        falsely_lost = [e for e in journal if e["kind"] == "host_lost"
                        and not (e.get("host") == "sim-00000" and e["ts"] >= silent_at)]
        by_client: dict[str, int] = {}
        for e in falsely_lost:
            k = str(int(e["host"].removeprefix("sim-")) // per)
            by_client[k] = by_client.get(k, 0) + 1
        unsent, unread = split_losses(falsely_lost, received.get("send_gaps", {}),
                                      HEARTBEAT_TIMEOUT_S)
        return {
            "agents": n,
            "tls": not insecure,
            "heartbeats": "stream" if stream_heartbeats else "datagram",
            "datagrams_given_up": sum(received.get("datagrams_given_up", {}).values()),
            # datagrams the kernel dropped meanwhile, for full receive buffers
            "udp_receive_buffer_drops": udp_receive_buffer_errors() - dropped_before,
            # ... of which on the controller's heartbeat socket, in the whole run
            "controller_socket_drops": controller_drops,
            "controller_cpu_share": round(cpu_share, 3),
            "status_call_s": status_call_s,
            "status_call_new_connection_s": new_status_call_s,
            "heartbeat_latency_p50_s": round(status.heartbeat_latency_p50_s, 4) if status else None,
            "heartbeat_latency_p99_s": round(status.heartbeat_latency_p99_s, 4) if status else None,
            # generation 1 stopped (a host lost) before the benchmark silenced
            # its agent: the stop fan-out below is that stop's
            "stopped_before_silence": stopped_early,
            "detection_s": round(lost["ts"] - silent_at, 3),
            "start_fanout_s": _last(arrived["start"], started["ts"]),
            "start_fanout_handled_s": _last(starts, started["ts"]),
            "starts_received": len(starts),
            "starts_by_datagram": len(received.get("start_arrived", {})),
            "stop_fanout_s": _last(arrived["stop"], stopping["ts"]),
            "stop_fanout_handled_s": _last(stops, stopping["ts"]),
            "stops_received": len(stops),
            "stops_by_datagram": len(received.get("stop_arrived", {})),
            "all_registered_s": round(started["ts"] - first_ts, 3),
            # agents whose first stream had sent its first message when the
            # generation started, by the clients' clocks (a start for any other
            # would wait in its outbox)
            "streams_open_at_start": sum(t <= started["ts"]
                                         for t in received.get("stream_opened", {}).values()),
            "registrations_deferred": sum(received.get("deferred", {}).values()),
            # streams without a first answer for as long as a real agent waits
            # (elastic.agent.session.first_answer_wait_s): registered again
            "streams_given_up": sum(received.get("streams_given_up", {}).values()),
            "sessions_ended": _by_code(received.get("session_ended", {})),
            "session_end_details": received.get("first_details", {}),
            "client_max_lag_s": round(max(received.get("client_max_lag_s", {"": 0.0}).values()), 3),
            "false_host_lost": len(falsely_lost),
            # ... by the client process that simulated them (is one client stalled?)
            "false_host_lost_by_client": by_client,
            # ... of which the simulated agent had sent nothing for the
            # heartbeat timeout (its client process was behind: no fault of
            # the controller's), and the others: each host's silence as the
            # controller judged it and as its sender did (seconds; at most 20)
            "false_host_lost_unsent": len(unsent),
            # simulated agents whose heartbeat or inbox task failed (must be 0)
            "agent_tasks_failed": sum(received.get("tasks_failed", {}).values()),
            "false_host_lost_unread": [[e["host"], round(e["ts"] - first_ts, 1), e["silent_s"],
                                        unsent_s, e.get("controller_lag_s")]
                                       for e, unsent_s in unread[:20]],
            "false_host_lost_unread_count": len(unread),
            # gaps in the simulated agents' sending (the silenced one aside)
            "send_gaps": sum(len(g) for h, g in received.get("send_gaps", {}).items()
                             if h != "sim-00000"),
            "longest_send_gap_s": max((b - a for h, g in received.get("send_gaps", {}).items()
                                       if h != "sim-00000" for a, b in g), default=0.0),
            # a new call once a second from a third process (is gRPC's intake stalled?)
            "intake_probe": probe.summary(first_ts),
            "max_controller_lag_s": max((e.get("controller_lag_s", 0.0) for e in journal
                                         if e["kind"] == "host_lost"), default=0.0),
        }


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "client":
        _, _, address, first, count, out, ca_dir = sys.argv
        asyncio.run(client_main(address, "scale", int(first), int(count), out, ca_dir))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, nargs="+", default=[1000, 5000, 10000])
    parser.add_argument("--steady-s", type=float, default=20.0)
    parser.add_argument("--insecure", action="store_true",
                        help="plaintext gRPC (to measure what mutual TLS costs)")
    parser.add_argument("--stream-heartbeats", action="store_true",
                        help="heartbeats on the agents' gRPC streams only (datagram_heartbeats = "
                             "false), to compare with datagrams")
    parser.add_argument("--out", default=None,
                        help="default bench/results/scale[_insecure].json")
    add_keep_flag(parser)
    args = parser.parse_args()
    args.out = args.out or str(REPO / "bench" / "results" /
                               f"scale{'_insecure' if args.insecure else ''}.json")
    rows = []
    for n in args.agents:
        row = run_size(n, args.steady_s, args.insecure, args.stream_heartbeats, args.keep)
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(f"\n{'TLS' if not args.insecure else 'plaintext'}, heartbeats "
          f"{'on the streams' if args.stream_heartbeats else 'as datagrams'}:")
    print(f"{'agents':>7} {'ctl CPU':>8} {'hb p50':>8} {'hb p99':>8} {'detect':>8} "
          f"{'start fan-out':>14} {'stop fan-out':>13} {'registered':>11} {'deferred':>9} "
          f"{'false lost':>11}   (fan-out: arrived / handled by the clients)")
    for r in rows:
        print(f"{r['agents']:>7} {100 * r['controller_cpu_share']:7.1f}% "
              f"{_ms(r['heartbeat_latency_p50_s']):>8} {_ms(r['heartbeat_latency_p99_s']):>8} "
              f"{r['detection_s']:7.2f}s {r['start_fanout_s']:5.2f} / {r['start_fanout_handled_s']:5.2f}s "
              f"{r['stop_fanout_s']:4.2f} / {r['stop_fanout_handled_s']:4.2f}s "
              f"{r['all_registered_s']:10.1f}s {r['registrations_deferred']:9d} "
              f"{r['false_host_lost']:11d}")
    write_result(args.out, {"date": time.strftime("%Y-%m-%d"), "machine": machine(),
                            "client_processes": CLIENT_PROCESSES, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())

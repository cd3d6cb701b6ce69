"""Benchmark: what the controller's own code costs per heartbeat and per
command, in one process, with nothing else competing for its core.

`bench/scale.py` measures the whole control plane end to end, but on a
2-core machine its simulated agents (four client processes) take about one
core and wake for every datagram, and loopback UDP does the receiver's
kernel work inside the sender's `sendto`: its figures at 10,000 agents are
the machine's as much as the controller's. This one drives the real
objects — `Controller`, `ControllerServicer`, `Executor`, AES-GCM sealed
datagrams, and `sendto` over loopback UDP to one receiving socket — without
gRPC, the event loop's I/O or any other process, so that each figure is the
controller's code alone:

- heartbeat: `ControllerServicer.datagram_received` for one sealed heartbeat
  datagram from each of N registered hosts (open, parse, admission checks,
  the view's update, and an ack sealed and sent every second heartbeat, as
  at 1 Hz with the default timeout), per heartbeat; and the share of one
  core that N hosts at 1 Hz would take;
- grouping: `newest_per_host` over a batch of N datagrams (how the
  endpoint reads a backlog), per datagram;
- stop fan-out: `Executor.apply` of a slice stop to N hosts heard by
  datagram (the message built once, sealed and sent for each host), in
  all and per host; start fan-out: the same for a generation's starts
  (each host's own: its rank, its snapshot buddy, the next slices);
- decision pass: `decide` for N registered idle hosts waiting for one more
  (every pass while a slice waits), the pass that starts a slice of the N
  (planning the mesh and the slices a lost host would leave: once per
  generation), and a pass over a running slice of N hosts (every tick).

Medians of `--rounds` rounds. Prints a table and writes JSON (`--out`).

    .venv/bin/python bench/controller_costs.py --hosts 1000 10000
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import pathlib
import socket
import statistics
import sys
import tempfile
import time

from common import machine, write_result

REPO = pathlib.Path(__file__).resolve().parent.parent

SPEC = """
[job]
id = "costs"
command = ["true"]
min_hosts = {more}
max_hosts = {more}

[health]
heartbeat_interval_s = 1.0
heartbeat_timeout_s = 5.0
"""


def _median_s(call, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def measure(n: int, rounds: int) -> dict:
    """The figures above for `n` hosts (seconds and shares; see the module
    docstring)."""
    from elastic import heartbeat_datagram as hd
    from elastic.clock import SystemClock
    from elastic.config import load_spec
    from elastic.controller.core import Controller
    from elastic.controller.datagrams import newest_per_host
    from elastic.controller.executor import Session
    from elastic.controller.journal import JournalWriter
    from elastic.controller.servicer import ControllerServicer
    from elastic.policy import decide as d
    from elastic.policy import view as v
    from elastic.v1 import control_pb2 as pb

    with tempfile.TemporaryDirectory(prefix="elastic-costs-") as tmp:
        spec_path = pathlib.Path(tmp) / "job.toml"
        spec_path.write_text(SPEC.format(more=n + 1))  # (one host short: waiting)
        spec = load_spec(spec_path)
        controller = Controller(spec, JournalWriter(pathlib.Path(tmp) / "state"), SystemClock())
        servicer = ControllerServicer(controller, authenticated=False)
        receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            receiver.bind(("127.0.0.1", 0))
            sender.setblocking(False)
            address = receiver.getsockname()

            def reply(data: bytes) -> None:  # (a full receiver drops it, as a network might)
                try:
                    sender.sendto(data, address)
                except OSError:
                    pass

            agents = []
            for i in range(n):
                host, incarnation, key = f"sim-{i:05d}", f"inc-{i}", hd.new_key()
                session = controller.sessions[host] = Session(host, incarnation)
                session.datagrams = hd.DatagramChannel(key, host, hd.TO_AGENT)
                session.attached = True
                controller.submit(v.Registered(
                    host_id=host, incarnation=incarnation, devices=1, address="127.0.0.1",
                    failure_domain=host, agent_pid=1, free_port=1, worker=v.WorkerObs(),
                    device_kind="cpu"))
                agents.append((hd.DatagramChannel(key, host, hd.TO_CONTROLLER), host,
                               incarnation))

            seq = 0

            def heartbeats() -> list[bytes]:
                nonlocal seq
                batch = []
                for channel, host, incarnation in agents:
                    seq += 1
                    message = pb.AgentMessage(
                        header=pb.Header(job_id=spec.job_id, host_id=host,
                                         incarnation=incarnation, seq=seq),
                        heartbeat=pb.Heartbeat(seq=seq, sent_at=time.time(), free_port=1,
                                               worker=pb.WorkerStatus(
                                                   state=pb.WORKER_IDLE, step=-1,
                                                   committed_step=-1)))
                    batch.append(channel.seal(message.SerializeToString()))
                return batch

            per_heartbeat = []
            for round_ in range(rounds):
                batch = heartbeats()
                # half the hosts acked in each round, alternating: every second
                # heartbeat of a host acked, as at 1 Hz with the default timeout
                now = controller.clock.monotonic()
                for i, session in enumerate(controller.sessions.values()):
                    session.datagram_acked_at = now if (i + round_) % 2 else float("-inf")
                t0 = time.perf_counter()
                for data in batch:
                    servicer.datagram_received(data, reply)
                per_heartbeat.append((time.perf_counter() - t0) / n)
                await asyncio.sleep(0)
            assert controller.datagrams_refused == 0, controller.datagrams_refused
            heartbeat_s = statistics.median(per_heartbeat)

            batch = [(data, address) for data in heartbeats()]
            grouping_s = _median_s(lambda: newest_per_host(batch), rounds) / n

            waiting_pass_s = _median_s(lambda: d.decide(controller.state, controller.view,
                                                        controller.clock.monotonic(), spec),
                                       rounds)
            enough = dataclasses.replace(spec, min_hosts=n, max_hosts=n)
            start_pass_s = _median_s(lambda: d.decide(controller.state, controller.view,
                                                      controller.clock.monotonic(), enough),
                                     rounds)

            hosts = list(controller.sessions)
            for session in controller.sessions.values():
                session.datagram_reply = reply
                session.datagram_heard_at = controller.clock.monotonic()
            def apply_s(actions: tuple) -> float:
                """Median seconds of Executor.apply(actions); the stream copies
                it holds back are dropped between rounds (not this figure)."""
                times = []
                for _ in range(rounds):
                    t0 = time.perf_counter()
                    controller.executor.apply(actions)
                    times.append(time.perf_counter() - t0)
                    for session in controller.sessions.values():
                        session.copy_due = None
                return statistics.median(times)

            stop_fanout_s = apply_s(tuple(
                [d.Journal("slice_stopping", 1, "bench", hosts[0], {})] +
                [d.StopWorker(host, 1, 0.0, f"host {hosts[0]} lost") for host in hosts]))
            start_fanout_s = apply_s(tuple(
                [d.Journal("generation_started", 2, "bench", None, {})] +
                [d.StartWorker(host, 2, rank, n, f"127.0.0.1:{20000 + rank % 1000}", 1,
                               hosts[(rank + 1) % n], "127.0.0.1:7471", ((n - 1, 1),))
                 for rank, host in enumerate(hosts)]))

            for host in hosts:
                controller.submit(v.HeartbeatReceived(
                    host, controller.view.hosts[host].incarnation,
                    v.WorkerObs(generation=1, state=v.WorkerState.RUNNING, step=5), 1))
            running = d.SliceState(
                phase=d.Phase.RUNNING, generation=1, phase_since=controller.clock.monotonic(),
                members=tuple(hosts),
                incarnations=tuple(controller.view.hosts[h].incarnation for h in hosts),
                progressed=True, devices_per_host=1, device_kind="cpu")
            running_pass_s = _median_s(lambda: d.decide(running, controller.view,
                                                        controller.clock.monotonic(), spec),
                                       rounds)
        finally:
            receiver.close()
            sender.close()
    return {"hosts": n,
            "heartbeat_us": round(heartbeat_s * 1e6, 2),
            "heartbeats_core_share_at_1hz": round(heartbeat_s * n, 4),
            "grouping_us_per_datagram": round(grouping_s * 1e6, 2),
            "stop_fanout_s": round(stop_fanout_s, 4),
            "stop_us_per_host": round(stop_fanout_s / n * 1e6, 2),
            "start_fanout_s": round(start_fanout_s, 4),
            "start_us_per_host": round(start_fanout_s / n * 1e6, 2),
            "waiting_pass_ms": round(waiting_pass_s * 1e3, 2),
            "start_pass_ms": round(start_pass_s * 1e3, 2),
            "running_pass_ms": round(running_pass_s * 1e3, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" /
                                             "controller_costs.json"))
    args = parser.parse_args()
    rows = [asyncio.run(measure(n, args.rounds)) for n in args.hosts]
    print(f"\n{'hosts':>6} {'heartbeat':>10} {'at 1 Hz':>8} {'grouping':>9} "
          f"{'stop fan-out':>13} {'per host':>9} {'start fan-out':>14} {'per host':>9} "
          f"{'waiting pass':>13} {'start pass':>11} {'running pass':>13}")
    for r in rows:
        share = 100 * r["heartbeats_core_share_at_1hz"]
        print(f"{r['hosts']:6d} {r['heartbeat_us']:8.1f}us {share:7.1f}% "
              f"{r['grouping_us_per_datagram']:7.2f}us {r['stop_fanout_s']:12.3f}s "
              f"{r['stop_us_per_host']:7.1f}us {r['start_fanout_s']:13.3f}s "
              f"{r['start_us_per_host']:7.1f}us {r['waiting_pass_ms']:11.2f}ms "
              f"{r['start_pass_ms']:9.1f}ms {r['running_pass_ms']:11.2f}ms")
    write_result(args.out, {"date": time.strftime("%Y-%m-%d"), "machine": machine(),
                            "python": sys.version.split()[0], "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Status of a job: the JobStatus message and its plain-text table."""

from __future__ import annotations

from elastic import transport
from elastic.controller.journal import job_entries
from elastic.goodput import account
from elastic.security.tls import TLSFiles
from elastic.v1 import control_pb2 as pb
from elastic.v1 import control_pb2_grpc as pb_grpc


def fetch_status(address: str, tls: TLSFiles | None, timeout_s: float = 5.0) -> pb.JobStatus:
    """GetStatus from the controller at "HOST:PORT" with an operator's (or
    the controller's) TLS files, plaintext if None, on a new connection.
    Raises grpc.RpcError, TLSError when the files cannot be used."""
    with transport.channel(address, tls) as ch:
        return status_on(ch, timeout_s)


def status_on(channel, timeout_s: float = 5.0) -> pb.JobStatus:
    """GetStatus on an open blocking `channel` to the controller, waiting
    up to `timeout_s` seconds. Raises grpc.RpcError."""
    return pb_grpc.ControllerStub(channel).GetStatus(pb.StatusRequest(), timeout=timeout_s)


def slice_step(status: pb.JobStatus) -> int:
    """The step the slice has reached: the lowest last step of its members
    (-1 before any)."""
    steps = [h.step for h in status.hosts if h.state == "member"]
    return min(steps) if steps else -1


def job_status(controller) -> pb.JobStatus:
    """A JobStatus snapshot of `controller` (a Controller)."""
    state, view, now = controller.state, controller.view, controller.clock.monotonic()
    ranks = {h: i for i, h in enumerate(state.members)} if not state.phase.terminal else {}
    hosts = []
    for record in sorted(view.hosts.values(), key=lambda r: r.host_id):
        note = ""
        if record.host_id in state.lost:
            host_state = "lost"
        elif record.host_id in state.quarantined:
            host_state, note = "quarantined", state.quarantined[record.host_id][1]
        elif record.preemption:
            host_state, note = "leaving", record.preemption
        elif record.host_id in state.carried:
            host_state = "silent"
            note = (f"agent silent for {now - record.last_heartbeat_at:.1f} s; its worker "
                    f"still trains with the slice (health.carry_silent_hosts)")
        elif record.host_id in ranks:
            host_state = "stopping" if state.phase.value == "stopping" else "member"
            if 0 < state.devices_per_host < record.devices:
                note = f"uses {state.devices_per_host} of its {record.devices} devices"
        elif record.host_id in state.left_out:
            host_state, note = "left out", state.left_out[record.host_id]
        else:
            host_state = "waiting"
        w = record.worker
        session = controller.sessions.get(record.host_id)
        path = session.heartbeat_path if session is not None and \
            session.incarnation == record.incarnation else ""
        hosts.append(pb.HostStatus(
            host_id=record.host_id, state=host_state, devices=record.devices,
            agent_pid=record.agent_pid, worker_pid=w.pid if w.running else 0,
            heartbeat_age_s=max(0.0, now - record.last_heartbeat_at), step=w.step,
            rank=ranks.get(record.host_id, -1), failure_domain=record.failure_domain,
            incarnation=record.incarnation, worker_state=w.state.value,
            address=record.address, metrics=w.metrics, note=note,
            device_kind=record.device_kind, service_port=record.service_port,
            metrics_port=record.metrics_port, heartbeat_path=path))
    goodput = account(job_entries(controller.journal_tail.read(), controller.spec.job_id),
                      now=controller.clock.time())
    latencies = sorted(controller.receipts.latencies())
    p50 = latencies[len(latencies) // 2] if latencies else 0.0
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else 0.0
    return pb.JobStatus(job_id=controller.spec.job_id, phase=state.phase.value,
                        generation=state.generation, restarts=state.restarts,
                        reason=state.reason, hosts=hosts,
                        committed_step=view.committed_step,
                        phase_age_s=max(0.0, now - state.phase_since), ettr=goodput.ettr,
                        heartbeat_latency_p50_s=p50, heartbeat_latency_p99_s=p99,
                        last_failure=last_failure(goodput.incidents))


def last_failure(incidents) -> str:
    """The latest incident that stopped the slice (elastic.goodput.Incident),
    with the failing host's last words, as `elasticd status` shows it; ""
    if none."""
    stopped = [i for i in incidents if i.restarted and i.noticed]
    if not stopped:
        return ""
    i = stopped[-1]
    text = f"generation {i.generation}, {i.kind} on {i.host or '-'}: {i.reason}"
    return text + (f"\n{i.last_words}" if i.last_words else "")


def format_status(status: pb.JobStatus) -> str:
    """The plain table `elasticd status` prints."""
    lines = [f"job {status.job_id}: {status.phase}, generation {status.generation}, "
             f"{status.restarts} restarts, committed step {status.committed_step}, "
             f"ETTR {100 * status.ettr:.1f} %",
             f"  {status.reason}", ""]
    header = ("HOST", "STATE", "RANK", "DEVICES", "AGENT PID", "WORKER PID", "WORKER",
              "HEARTBEAT AGE", "STEP", "LOSS")
    rows = [header] + [
        (h.host_id, h.state, str(h.rank) if h.rank >= 0 else "-",
         f"{h.devices} {h.device_kind}".rstrip(),
         str(h.agent_pid), str(h.worker_pid or "-"), h.worker_state,
         f"{h.heartbeat_age_s:.1f} s" + (f" ({h.heartbeat_path})" if h.heartbeat_path else ""),
         str(h.step) if h.step >= 0 else "-",
         f"{h.metrics['loss']:.4f}" if "loss" in h.metrics else "-")
        for h in status.hosts]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines += [f"  {h.host_id} {h.state}: {h.note}" for h in status.hosts if h.note]
    if status.last_failure:
        first, *words = status.last_failure.splitlines()
        lines += ["", f"last failure: {first}", *(f"  | {line}" for line in words)]
    return "\n".join(lines)

"""The controller's Prometheus metrics (`elasticd start --metrics-port`).

State (read at each scrape from a snapshot the event loop takes, the same
`JobStatus` that `elasticd status` shows):
  elastic_job_phase{phase}              1 for the phase the job is in, else 0
  elastic_generation                    the generation running or last started
  elastic_hosts_alive                   hosts registered and not lost
  elastic_hosts_expected                the job's max_hosts (and _min: min_hosts)
  elastic_slice_hosts                   hosts in the running generation
  elastic_step / elastic_committed_step the slice's step, the latest committed one
  elastic_steps_per_second              1 / the median step time rank 0 reports (else
                                        the steps since the last scrape, per second)
  elastic_ettr_ratio                    productive / wall time so far (elastic.goodput)
  elastic_slice_restarts_total          restarts of the slice in the job
  elastic_controller_lag_seconds        how late its event loop ran lately (see
                                        elastic.controller.lag)
  elastic_registrations_deferred_total  registrations refused while it was behind,
                                        or while admitted ones' streams waited
  elastic_heartbeat_datagrams_total{outcome}  heartbeat datagrams taken / dropped /
                                        superseded / overflowed (dropped by the kernel)
  elastic_hosts_heartbeating{path}      hosts whose latest heartbeat came as a
                                        datagram / on the stream
  elastic_journal_lines_lost_total      journal lines the disk refused (full, failing):
                                        lost, and the controller went on
Events (fed by the journal as it is written):
  elastic_incidents_total{kind}         host_lost, hang_detected, worker_failed,
                                        preemption_notice, agent_silent, ...
  elastic_slice_stops_total{cause}      failure, preemption, grow, adoption
  elastic_detection_latency_seconds     failure -> slice stopping, per incident
  elastic_recovery_latency_seconds      failure -> first step of the next generation
  elastic_checkpoint_save_blocking_seconds  how long a save blocked the loop
  elastic_checkpoint_commit_seconds     save started -> committed
  elastic_heartbeat_latency_seconds     agent send -> controller receipt
Detection and recovery are the incidents of `elasticd report`
(elastic.goodput), observed once each when the next generation makes its
first step (or the job ends).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from elastic.controller.journal import job_entries
from elastic.controller.status import job_status, slice_step
from elastic.goodput import account
from elastic.metrics import LoopCollector
from elastic.policy.state import Phase

#: Journal kinds counted as incidents (worker_exited only when it failed).
INCIDENT_KINDS = frozenset({"host_lost", "hang_detected", "preemption_notice", "agent_silent",
                            "checkpoint_save_failed", "checkpoint_restore_failed",
                            "controller_paused", "host_quarantined"})
#: Entries after which the incidents so far are accounted (elastic.goodput).
_ACCOUNT_KINDS = frozenset({"first_progress", "agent_heard", "job_succeeded", "job_failed"})
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0,
                   120.0)
SAVE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
HEARTBEAT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class ControllerMetrics:
    """The registry of one controller (`registry`, for elastic.metrics.serve).
    `on_journal(entry)` must see every journal entry as it is written, and
    `on_heartbeat(latency_s)` every heartbeat's latency; both run on the
    event loop."""

    def __init__(self, controller, loop) -> None:
        self.controller = controller
        r = self.registry = CollectorRegistry()
        self.incidents = Counter("elastic_incidents", "Incidents by journal kind", ["kind"],
                                 registry=r)
        self.stops = Counter("elastic_slice_stops", "Slice stops by cause", ["cause"],
                             registry=r)
        self.detection = Histogram("elastic_detection_latency_seconds",
                                   "Failure to slice stopping, per incident",
                                   buckets=LATENCY_BUCKETS, registry=r)
        self.recovery = Histogram("elastic_recovery_latency_seconds",
                                  "Failure to the first step of the next generation",
                                  buckets=LATENCY_BUCKETS, registry=r)
        self.save_blocking = Histogram("elastic_checkpoint_save_blocking_seconds",
                                       "How long a checkpoint save blocked the training loop",
                                       buckets=SAVE_BUCKETS, registry=r)
        self.commit = Histogram("elastic_checkpoint_commit_seconds",
                                "Checkpoint save started to committed", buckets=SAVE_BUCKETS,
                                registry=r)
        self.heartbeat = Histogram("elastic_heartbeat_latency_seconds",
                                   "Agent send to controller receipt of a heartbeat",
                                   buckets=HEARTBEAT_BUCKETS, registry=r)
        r.register(LoopCollector(loop, lambda: job_status(controller), self._state))
        self._saved_at: dict[int, float] = {}  # checkpoint step -> when its save started
        self._last_scrape = (0, -1, 0.0)  # (generation, step, monotonic seconds)
        self._accounted: set[tuple] = set()

    def on_heartbeat(self, latency_s: float) -> None:
        self.heartbeat.observe(max(0.0, latency_s))

    def on_journal(self, entry: dict) -> None:
        kind = entry["kind"]
        if kind in INCIDENT_KINDS:
            self.incidents.labels(kind).inc()
        elif kind == "worker_exited" and not entry.get("stopped_on_request") and (
                entry.get("exit_code") or entry.get("signal")):
            self.incidents.labels("worker_failed").inc()
        elif kind == "slice_stopping":
            self.stops.labels(str(entry.get("cause", ""))).inc()
        elif kind == "checkpoint_saved" and isinstance(entry.get("step"), int):
            if isinstance(entry.get("blocking_s"), (int, float)):
                self.save_blocking.observe(entry["blocking_s"])
            self._saved_at.setdefault(entry["step"], entry["ts"])
        elif kind == "checkpoint_committed" and entry.get("step") in self._saved_at:
            self.commit.observe(max(0.0, entry["ts"] - self._saved_at.pop(entry["step"])))
            for step in [s for s in self._saved_at if s < entry["step"]]:
                del self._saved_at[step]  # (saves that never committed)
        if kind in _ACCOUNT_KINDS:
            self._account(final=kind.startswith("job_"))

    def _account(self, final: bool) -> None:
        """Observe the incidents elastic.goodput finds that are over (or all,
        at the job's end) and were not observed before."""
        entries = job_entries(self.controller.journal_tail.read(), self.controller.spec.job_id)
        for incident in account(entries).incidents:
            key = (incident.kind, incident.host, incident.generation, incident.at)
            if key in self._accounted or not incident.noticed or (
                    incident.recovered_after_s is None and not final):
                continue
            self._accounted.add(key)
            self.detection.observe(incident.detected_after_s)
            if incident.recovered_after_s is not None:
                self.recovery.observe(incident.recovered_after_s)

    def _state(self, st):
        spec = self.controller.spec
        phase = GaugeMetricFamily("elastic_job_phase", "1 for the job's phase", labels=["phase"])
        for p in Phase:
            phase.add_metric([p.value], 1.0 if st.phase == p.value else 0.0)
        yield phase
        members = [h for h in st.hosts if h.rank >= 0]
        rank0 = next((h for h in members if h.rank == 0), None)
        step_time = rank0.metrics.get("step_time_s", 0.0) if rank0 is not None else 0.0
        running = st.phase == Phase.RUNNING.value
        step, now = slice_step(st), self.controller.clock.monotonic()
        rate = 1.0 / step_time if running and step_time > 0 else 0.0
        if running and not rate and self._last_scrape[0] == st.generation and \
                now > self._last_scrape[2]:  # (a worker that reports no step time)
            rate = max(0.0, (step - self._last_scrape[1]) / (now - self._last_scrape[2]))
        self._last_scrape = (st.generation, step, now)
        for name, doc, value in (
                ("elastic_generation", "The generation running or last started", st.generation),
                ("elastic_hosts_alive", "Hosts registered and not lost",
                 sum(h.state != "lost" for h in st.hosts)),
                ("elastic_hosts_expected", "The job's max_hosts", spec.max_hosts),
                ("elastic_hosts_expected_min", "The job's min_hosts", spec.min_hosts),
                ("elastic_slice_hosts", "Hosts in the running generation", len(members)),
                ("elastic_step", "The slice's step (-1: none yet)", step),
                ("elastic_committed_step", "The latest committed checkpoint step",
                 st.committed_step),
                ("elastic_steps_per_second", "1 / the median step time rank 0 reports (or "
                 "the steps since the last scrape, when it reports none)", rate),
                ("elastic_ettr_ratio", "Productive time / wall time so far", st.ettr),
                ("elastic_phase_age_seconds", "Seconds in the current phase", st.phase_age_s)):
            yield GaugeMetricFamily(name, doc, value=float(value))
        yield CounterMetricFamily("elastic_slice_restarts", "Restarts of the slice in the job",
                                  value=float(st.restarts))
        yield GaugeMetricFamily("elastic_controller_lag_seconds", "How late the controller's "
                                "event loop ran lately (silence is judged against it)",
                                value=self.controller.view.lag_s)
        yield CounterMetricFamily("elastic_registrations_deferred", "Registrations refused "
                                  "with a retry-after hint while the controller was behind "
                                  "or admitted ones' streams waited to be taken up",
                                  value=float(self.controller.registrations_deferred))
        datagrams = CounterMetricFamily("elastic_heartbeat_datagrams", "Heartbeat datagrams "
                                        "taken; dropped (malformed, forged, replayed or "
                                        "overtaken); superseded (a newer one of the same "
                                        "host read with it was taken); or overflowed (the "
                                        "kernel dropped it, the controller's socket full)",
                                        labels=["outcome"])
        datagrams.add_metric(["taken"], float(self.controller.datagrams_received))
        datagrams.add_metric(["dropped"], float(self.controller.datagrams_refused))
        datagrams.add_metric(["superseded"], float(self.controller.datagrams_superseded))
        datagrams.add_metric(["overflowed"], float(self.controller.drops.total))
        yield datagrams
        copies = CounterMetricFamily("elastic_command_stream_copies", "Stream copies of starts "
                                     "and stops sent as datagrams: sent (the host had not "
                                     "acted on the datagram a heartbeat interval later: lost, "
                                     "or its report was), or skipped", labels=["outcome"])
        copies.add_metric(["sent"], float(self.controller.executor.copies_sent))
        copies.add_metric(["skipped"], float(self.controller.executor.copies_skipped))
        yield copies
        yield CounterMetricFamily("elastic_journal_lines_lost", "Journal lines the disk "
                                  "refused (full or failing): lost, the controller went on",
                                  value=float(self.controller.executor.journal.lost_lines))
        paths = GaugeMetricFamily("elastic_hosts_heartbeating", "Hosts by how their latest "
                                  "heartbeat came", labels=["path"])
        for path in ("datagram", "stream"):
            paths.add_metric([path], float(sum(h.heartbeat_path == path for h in st.hosts)))
        yield paths

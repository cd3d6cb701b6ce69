"""An agent's Prometheus metrics (`elastic-agent --metrics-port`), read at
each scrape from a snapshot its event loop takes (elastic.metrics):

  elastic_agent_controller_connected    1 while a session with a controller is open
  elastic_agent_sessions_total          sessions opened (registrations that streamed)
  elastic_agent_generation              the generation of its current or last worker
  elastic_agent_worker_running          1 while its worker runs
  elastic_agent_worker_step             the worker's last reported step (-1: none)
  elastic_agent_worker_committed_step   the latest checkpoint step it saw committed
  elastic_agent_worker_exits_total{outcome}  succeeded, failed, stopped (on request)
  elastic_agent_devices                 accelerators counted now
  elastic_agent_heartbeats_total        heartbeats sent
  elastic_agent_fenced                  1 after it stopped its worker on its own
  elastic_agent_preempted               1 once its host is being taken away
  elastic_agent_replicas_sent_total     snapshots sent to its buddy (elastic.agent.replicas)
  elastic_agent_replica_failures_total  snapshots it failed to send
  elastic_agent_replica_step            the step of the last snapshot sent (-1: none)
  elastic_agent_replica_send_seconds    how long the last one took to send
  elastic_agent_replicas_received_total peers' snapshots it keeps
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from elastic.metrics import LoopCollector


def agent_registry(agent, loop) -> CollectorRegistry:
    """The registry of `agent` (an elastic.agent.agent.Agent)."""
    registry = CollectorRegistry()
    registry.register(LoopCollector(loop, agent.metrics_snapshot, _families))
    return registry


def _families(s: dict):
    for name, doc, value in (
            ("elastic_agent_controller_connected", "1 while a controller session is open",
             s["connected"]),
            ("elastic_agent_generation", "Generation of the current or last worker",
             s["generation"]),
            ("elastic_agent_worker_running", "1 while the worker runs", s["running"]),
            ("elastic_agent_worker_step", "The worker's last reported step", s["step"]),
            ("elastic_agent_worker_committed_step", "Latest committed checkpoint step seen",
             s["committed"]),
            ("elastic_agent_devices", "Accelerators counted now", s["devices"]),
            ("elastic_agent_fenced", "1 after the agent stopped its worker on its own",
             s["fenced"]),
            ("elastic_agent_preempted", "1 once the host is being taken away", s["preempted"]),
            ("elastic_agent_replica_step", "Step of the last snapshot sent to the buddy",
             s["replica_step"]),
            ("elastic_agent_replica_send_seconds", "Seconds the last replica took to send",
             s["replica_send_s"])):
        yield GaugeMetricFamily(name, doc, value=float(value))
    yield CounterMetricFamily("elastic_agent_sessions", "Controller sessions opened",
                              value=float(s["sessions"]))
    yield CounterMetricFamily("elastic_agent_heartbeats", "Heartbeats sent",
                              value=float(s["heartbeats"]))
    for name, doc, key in (
            ("elastic_agent_replicas_sent", "Snapshots sent to the buddy host", "replicas_sent"),
            ("elastic_agent_replica_failures", "Snapshots not sent to the buddy host",
             "replica_failures"),
            ("elastic_agent_replicas_received", "Peers' snapshots kept", "replicas_received")):
        yield CounterMetricFamily(name, doc, value=float(s[key]))
    exits = CounterMetricFamily("elastic_agent_worker_exits", "Worker exits by outcome",
                                labels=["outcome"])
    for outcome in ("succeeded", "failed", "stopped"):
        exits.add_metric([outcome], float(s["exits"].get(outcome, 0)))
    yield exits

"""The controller's decisions: one pure, level-triggered function.

`decide(state, view, now, spec)` compares what is wanted (a running slice of
the hosts alive now) with what is observed (`ClusterView`) and returns the next
`SliceState`, the actions for the executor and a one-line reason. It reads no
clock (`now` is controller-monotonic seconds), does no I/O and does not
mutate the view, so tests build a state by hand, pick `now` and assert on the
decision (after torchft's lighthouse `quorum_compute`).

Phases: WAITING (for hosts) -> STARTING (generation g sent, no step yet) ->
RUNNING -> STOPPING -> WAITING (then g+1) | SUCCEEDED | FAILED. A controller
that starts on a journal whose generation was still running begins in
ADOPTING (elastic.policy.adopt) -> RUNNING (or STARTING) of that same
generation, or STOPPING when the agents' reports disagree with the journal.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Set

from elastic.config import JobSpec
from elastic.policy import (adopt, blame, closed, crash_loop, drain, failure_history, fencing,
                            grow, quarantine, silence, strays)
# the state and the actions (re-exported: callers name them decide.X)
from elastic.policy.state import (  # noqa: F401
    Action, Decision, Finish, Journal, Phase, SliceState, StartWorker, StopWorker)
from elastic.policy.hang import check_hang
from elastic.policy.mesh import MeshPlan, plan_mesh
from elastic.policy.slice_plan import (buddy_map, next_slices, plan_keeping_replicas,
                                       survivors_plan)
from elastic.policy.usable import candidate, opening_count, opening_text, usable
from elastic.policy.view import ClusterView, HostRecord, WorkerState

#: Seconds after the controller started that the first generation waits at
#: most for `health.expected_hosts` (TorchElastic's rendezvous waits 30 s
#: after `min_nodes` for more by default: its `last_call_timeout`).
EXPECTED_WAIT_S = 30.0


def decide(state: SliceState, view: ClusterView, now: float, spec: JobSpec) -> Decision:
    """One reconcile pass. See the module docstring."""
    if state.phase.terminal:
        return Decision(state, (), state.reason)
    actions: list[Action] = []
    state = _track_lost(state, view, now, spec, actions)
    if state.quarantined:
        quarantined, released = quarantine.release(state.quarantined, now)
        for host in released:
            actions.append(Journal("host_released", state.generation,
                                   "quarantine cooldown over", host))
        if released:
            state = dataclasses.replace(state, quarantined=quarantined)
    if state.phase is Phase.ADOPTING:
        return Decision(*_adopting(state, view, now, spec, actions))
    if state.phase is Phase.WAITING:
        state = _waiting(state, view, now, spec, actions)
    elif state.phase in (Phase.STARTING, Phase.RUNNING):
        state = _running(state, view, now, spec, actions)
    elif state.phase is Phase.STOPPING:
        state = _stopping(state, view, now, spec, actions)
    if not state.phase.terminal:  # (ADOPTING returned above)
        state = strays.stop_strays(state, view, now, spec, actions)
    return Decision(state, tuple(actions), state.reason)


# --- helpers -------------------------------------------------------------------

def _adopting(state: SliceState, view: ClusterView, now: float, spec: JobSpec,
              actions: list[Action]) -> tuple[SliceState, tuple[Action, ...], str]:
    """Adopt the inherited generation, restart it, or wait for its hosts.
    (No stray is stopped meanwhile: the workers being adopted look like strays.)"""
    window = adopt.window_s(spec.health.heartbeat_timeout_s)
    if state.inherited is None:  # the journal says nothing runs: do the agents?
        found = adopt.discover(view, state.generation, now - state.phase_since, window,
                               spec.max_hosts)
        if found is None:
            reason = "looking for a running generation in the agents' reports"
            return dataclasses.replace(state, reason=reason), tuple(actions), reason
        if found == "":
            state = _enter(state, Phase.WAITING, now, "waiting for the first hosts")
            return state, tuple(actions), state.reason
        actions.append(Journal(
            "generation_discovered", found.generation,
            f"the journal ends before generation {found.generation}, which "
            f"{len(found.hosts)} hosts report running with every rank", None,
            {"hosts": list(found.hosts), "incarnations": list(found.incarnations),
             "devices_per_host": found.devices_per_host, "device_kind": found.device_kind}))
        state = dataclasses.replace(state, inherited=found, generation=found.generation,
                                    restarts=state.restarts)
    inherited = state.inherited
    g = inherited.generation
    verdict = adopt.judge(inherited, view, now - state.phase_since, window)
    lost = [h for h in inherited.hosts if h in state.lost]
    if lost:  # (with a crash, the lost host is its likeliest cause)
        failed = verdict is not None and verdict.what == "failure"
        verdict = adopt.Verdict("failure" if failed else "restart", f"host {lost[0]} was lost "
                                f"before the slice could be adopted", (lost[0],) if failed else ())
    if verdict is None:
        here = sum(h in view.hosts for h in inherited.hosts)
        reason = (f"adopting generation {g}: {here} of its {len(inherited.hosts)} hosts "
                  f"registered")
        state = dataclasses.replace(state, reason=reason) if reason != state.reason else state
        return state, tuple(actions), state.reason
    what, why, blamed = verdict
    # (a member not back keeps the incarnation the journal names: should it
    # come back with its worker still running, it is no stopped stranger)
    journaled = inherited.incarnations or ("",) * len(inherited.hosts)
    incarnations = tuple(view.hosts[h].incarnation if h in view.hosts else known
                         for h, known in zip(inherited.hosts, journaled))
    common = dict(members=inherited.hosts, incarnations=incarnations,
                  coordinator=inherited.coordinator, devices_per_host=inherited.devices_per_host,
                  device_kind=inherited.device_kind, restarts=inherited.restarts,
                  inherited=None)
    steps = [view.hosts[h].worker.step for h in inherited.hosts if h in view.hosts]
    if what == "adopt":
        progressed = inherited.progressed or min(steps) >= 0
        # (a slice that made a step, away from the failure's that began the
        # crash-loop count, ends the count, as its first_progress or its stop
        # would have; the journal's reader counts it so: failure_history)
        passed = min(steps) >= 0 and crash_loop.got_away(state.failure_step, max(steps))
        actions.append(Journal("slice_adopted", g, why, None, {
            "hosts": list(inherited.hosts), "step": min(steps), "progressed": passed,
            "after_start_s": round(now - state.phase_since, 3)}))
        counted = {"failures_without_progress": 0, "failure_step": -1} if passed else {}
        state = _enter(state, Phase.RUNNING if progressed else Phase.STARTING, now,
                       f"generation {g} adopted on {len(inherited.hosts)} hosts",
                       progressed=progressed, **counted, **common)
    else:  # (a crash counts as any failure: towards the crash loop, whose count
        # needs whether the generation made a step, and the host's quarantine)
        failed, progressed = what == "failure", inherited.progressed or max(steps, default=-1) >= 0
        state = _begin_stop(
            dataclasses.replace(state, progressed=progressed, **common), view, now, spec, actions,
            "failure" if failed else "adoption",
            f"generation {g} failed: {why}" if failed else f"cannot adopt generation {g}: {why}",
            blamed, view.hosts.keys() - state.lost)
    return state, tuple(actions), state.reason


def _track_lost(state: SliceState, view: ClusterView, now: float, spec: JobSpec,
                actions: list[Action]) -> SliceState:
    timeout = spec.health.heartbeat_timeout_s
    cutoff = now - timeout - view.lag_s  # (a controller behind has not read them yet)
    lost = set(state.lost)
    carried = dict(state.carried)

    def lose(host: str, reason: str, fields: dict) -> None:
        lost.add(host)
        carried.pop(host, None)
        actions.append(Journal("host_lost", state.generation, reason, host, fields))

    silent = [r for r in view.silent(cutoff)
              if r.host_id not in lost and not silence.opening(r, now, view.lag_s)]
    # the slice's front step, O(members): only read when someone is silent
    front = _carry_front(state, view, now, spec) if silent or state.carried else None
    jump = silence.slice_jump((view.hosts[h] for h in state.members if h in view.hosts),
                              state.generation) if silent and front is not None else 0
    for record in silent:
        host = record.host_id
        silent_s = round(now - record.last_heartbeat_at, 3)
        lead = _lead(state, record, front)
        if lead >= silence.lead_needed(record, jump):
            if host not in carried:
                carried[host] = record.last_heartbeat_at
                actions.append(Journal(
                    "agent_silent", state.generation,
                    f"no heartbeat for {silent_s:.1f} s, but the slice went {lead} steps past "
                    f"its worker's last report (step {record.worker.step}): its worker still "
                    f"trains; kept in the slice", host,
                    {"silent_s": silent_s, "lead_steps": lead, "step": record.worker.step}))
            continue
        was = " (carried until the slice stopped stepping)" if host in carried else ""
        behind = f", the controller {view.lag_s:.1f} s behind" if view.lag_s else ""
        lose(host, f"no heartbeat for {silent_s:.1f} s (heartbeat_timeout_s = {timeout:g}"
             f"{behind}){was}", {"silent_s": silent_s, "controller_lag_s": round(view.lag_s, 3)})
    grace = spec.health.reconnect_grace_s + view.lag_s
    for host, at in view.disconnected.items():
        if host not in lost and now - at >= grace:
            lose(host, f"connection closed {now - at:.1f} s ago and not reopened "
                 f"(reconnect_grace_s = {grace:g})", {"disconnected_s": round(now - at, 3)})
    for host in state.lost:
        record = view.get(host)
        if record is not None and record.last_heartbeat_at >= cutoff and \
                host not in view.disconnected:
            lost.discard(host)
            actions.append(Journal("host_returned", state.generation,
                                   "heartbeats resumed", host))
    for host, since in state.carried.items():
        record = view.get(host)
        # heard again, and its step reports caught up (its agent's first
        # heartbeat may still carry the step it had when it went silent)
        if host in carried and record is not None and record.last_heartbeat_at >= cutoff and \
                _lead(state, record, front) < silence.CARRY_LEAD_STEPS:
            del carried[host]
            silent_s = round(record.last_heartbeat_at - since, 3)
            actions.append(Journal("agent_heard", state.generation,
                                   f"heartbeats resumed after {silent_s:.1f} s; its worker "
                                   f"trained on meanwhile", host, {"silent_s": silent_s}))
    if lost == state.lost and carried == state.carried:
        return state
    return dataclasses.replace(state, lost=frozenset(lost), carried=carried)


def _carry_front(state: SliceState, view: ClusterView, now: float, spec: JobSpec) -> int | None:
    """The step the running generation's members reached recently (see
    elastic.policy.silence), or None when carrying does not apply (not
    running, or `health.carry_silent_hosts` off)."""
    if not spec.health.carry_silent_hosts or state.phase is not Phase.RUNNING:
        return None
    return silence.slice_front((view.hosts[h] for h in state.members if h in view.hosts),
                               state.generation, now,
                               spec.health.heartbeat_timeout_s + view.lag_s)


def _lead(state: SliceState, record: HostRecord, front: int | None) -> int:
    """Steps the slice is ahead of a member's last report (0: not carried)."""
    if front is None or record.host_id not in state.members:
        return 0
    return silence.peer_lead(record, front, state.generation)


def _note_left_out(state: SliceState, plan: MeshPlan, actions: list[Action],
                   running: frozenset[str] = frozenset()) -> SliceState:
    """Keep the plan's left-out hosts in the state; journal each one whose
    reason is new. (Not counted as a failure of anyone: the host is fine,
    it only does not fit this slice.) Members of the `running` generation
    are not noted: the plan is only a possible grow, and they still train."""
    left_out = {h: why for h, why in plan.left_out.items() if h not in running}
    if left_out == dict(state.left_out):
        return state
    for host, why in sorted(left_out.items()):
        if state.left_out.get(host) != why:
            actions.append(Journal("host_left_out", state.generation, why, host,
                                   {"devices_per_host": plan.devices_per_host,
                                    "device_kind": plan.kind}))
    return dataclasses.replace(state, left_out=left_out)


def _enter(state: SliceState, phase: Phase, now: float, reason: str, **changes) -> SliceState:
    return dataclasses.replace(state, phase=phase, phase_since=now, reason=reason, **changes)


def _waiting(state: SliceState, view: ClusterView, now: float, spec: JobSpec,
             actions: list[Action]) -> SliceState:
    """Start the next generation if a plan allows; else wait, at most
    `restart.waiting_timeout_s` in all (then the job fails with the reason)."""
    # (a controller that started on a journal whose last failure used up a
    # limit, and died before its stop ended, finds it here)
    spent = failure_history.exhausted(state.failures_without_progress,
                                      failure_history.recent(state.failure_restarts, now, spec),
                                      spec)
    if spent:
        return _fail(state, now, actions, f"{spent} (counted before this controller started)")
    after = _try_start(state, view, now, spec, actions)
    limit = spec.restart.waiting_timeout_s
    if after.phase is Phase.WAITING and limit and now - state.phase_since >= limit:
        return _fail(after, now, actions,
                     f"no slice could start for {now - state.phase_since:.0f} s "
                     f"(restart.waiting_timeout_s = {limit:g}); last: {after.reason}")
    return after


def _try_start(state: SliceState, view: ClusterView, now: float, spec: JobSpec,
               actions: list[Action]) -> SliceState:
    if now < state.fenced_until:
        state = fencing.lift_fence(state, view, actions)
    if now < state.fenced_until:
        return dataclasses.replace(state, reason=fencing.waiting(state, now))
    heartbeating = len(view.hosts) - len(state.lost)
    if heartbeating < spec.min_hosts:  # O(1): no plan can start (thousands registering)
        reason = f"waiting for hosts: {heartbeating} heartbeating, min_hosts is {spec.min_hosts}"
        if now - state.waiting_journaled_at >= 30.0:
            actions.append(Journal("waiting_for_hosts", state.generation, reason))
            return dataclasses.replace(state, reason=reason, waiting_journaled_at=now)
        return dataclasses.replace(state, reason=reason)
    candidates = [candidate(r) for r in view.hosts.values() if usable(r, state, view)]
    plan = plan_mesh(spec, candidates)
    if not plan.hosts and state.quarantined and quarantine.settled(state, view, now, spec):
        state, candidates, plan = quarantine.release_for_start(state, view, spec, candidates,
                                                                   plan, actions)
    if not plan.hosts:
        state = _note_left_out(state, plan, actions)
        opening = opening_count(state, view, now)
        if opening:
            plan = dataclasses.replace(plan, reason=f"{plan.reason}; {opening_text(opening)}")
        # journaled on entering the wait and then at most every 30 s (status
        # always shows the current reason): hosts arriving one by one must not
        # write a line each
        if now - state.waiting_journaled_at >= 30.0:
            actions.append(Journal("waiting_for_hosts", state.generation, plan.reason))
            return dataclasses.replace(state, reason=plan.reason, waiting_journaled_at=now)
        return dataclasses.replace(state, reason=plan.reason) \
            if plan.reason != state.reason else state
    survivors = survivors_plan(state, spec, candidates, plan.hosts)
    if survivors is not None:
        plan = survivors  # newcomers join at the next grow; no settling for them
    plan = plan_keeping_replicas(state, view, spec, candidates, plan)
    if survivors is None and len(plan.hosts) < spec.max_hosts:
        # settle: more hosts may be on their way (registering, or registered
        # with their streams still opening: seconds, in a storm of thousands)
        last = max(view.last_registration_at, view.last_stream_opened_at)
        settle_left = last + spec.health.rendezvous_settle_s - now
        if settle_left > 0:
            return dataclasses.replace(
                state, reason=f"{len(plan.hosts)} hosts ready, waiting {settle_left:.1f} s "
                              f"more for up to {spec.max_hosts}")
        opening = opening_count(state, view, now)
        if opening:
            return dataclasses.replace(
                state, reason=f"{len(plan.hosts)} hosts ready; {opening_text(opening)}")
        expected = min(spec.health.expected_hosts, spec.max_hosts)
        wait_left = state.phase_since + EXPECTED_WAIT_S - now
        if state.generation == 0 and len(view.hosts) - len(state.lost) < expected and \
                wait_left > 0:
            return dataclasses.replace(
                state, reason=f"{len(plan.hosts)} hosts ready, waiting up to {wait_left:.1f} s "
                              f"more for the {expected} expected (health.expected_hosts)")
    # above every generation a worker reports too: a journal that ended
    # early (or a generation that could not be adopted) must not be reused
    generation = max(state.generation, max((r.worker.generation for r in view.hosts.values()),
                                           default=0)) + 1
    coordinator = view.hosts[plan.hosts[0]]
    address = f"{coordinator.address}:{coordinator.free_port}"
    if not coordinator.free_port or address == state.coordinator:
        # Never reuse the previous coordinator's port: its process may still
        # hold it. The agent offers a fresh one with its next heartbeat.
        return dataclasses.replace(state, reason=f"waiting for a fresh coordinator port "
                                                 f"from host {coordinator.host_id}")
    reason = f"generation {generation} on {plan.reason}, coordinator {plan.hosts[0]} at {address}"
    ahead = next_slices(spec, candidates, plan) if spec.restart.compile_ahead else ()
    actions.append(Journal("generation_started", generation, reason, None, {
        "hosts": list(plan.hosts), "mesh_shape": list(plan.shape),
        "devices_per_host": plan.devices_per_host, "device_kind": plan.kind,
        "next_slices": [list(s) for s in ahead],
        "coordinator": address, "restarts": state.restarts,
        "incarnations": [view.hosts[h].incarnation for h in plan.hosts]}))
    state = _note_left_out(dataclasses.replace(state, generation=generation), plan, actions)
    buddy = buddy_map(view, plan.hosts) if spec.restart.replicate_snapshots else {}
    senders: dict[str, list[str]] = {}
    for host, to in buddy.items():
        senders.setdefault(to, []).append(host)
    for rank, host in enumerate(plan.hosts):
        to = buddy.get(host, "")
        actions.append(StartWorker(
            host, generation, rank, len(plan.hosts), address, plan.devices_per_host, to,
            f"{view.hosts[to].address}:{view.hosts[to].service_port}" if to else "", ahead,
            tuple(senders.get(host, ()))))
    return _enter(state, Phase.STARTING, now, reason,
                  coordinator=address, members=plan.hosts,
                  incarnations=tuple(view.hosts[h].incarnation for h in plan.hosts),
                  progressed=False, grow_ready_since=None,
                  devices_per_host=plan.devices_per_host, device_kind=plan.kind,
                  waiting_journaled_at=float("-inf"))


def _member_failure(state: SliceState, record: HostRecord | None, host: str,
                    incarnation: str) -> blame.MemberFailure | None:
    """How member `host` (`record`: its record, None if it has none)
    failed in the current generation, None if it did not.
    A member whose agent now counts fewer devices than the generation puts
    in the mesh (a chip failed), or another kind, has failed too: its worker
    cannot go on, and the next plan leaves it out or shrinks the mesh."""
    if record is None or host in state.lost:
        return blame.MemberFailure(record.last_heartbeat_at if record else 0.0, host,
                                   f"host {host} lost")
    if record.incarnation != incarnation:
        return blame.MemberFailure(record.registered_at, host, (
            f"agent of host {host} restarted (incarnation {incarnation} -> "
            f"{record.incarnation})"))
    if state.devices_per_host and (record.devices < state.devices_per_host
                                   or record.device_kind != state.device_kind):
        kind = f" {record.device_kind}" if record.device_kind != state.device_kind else ""
        return blame.MemberFailure(record.devices_changed_at, host, (
            f"host {host} now reports {record.devices}{kind} device(s); generation "
            f"{state.generation} uses {state.devices_per_host} per host"))
    w = record.worker
    if w.generation == state.generation and w.state is WorkerState.EXITED and not w.succeeded:
        return blame.MemberFailure(record.exited_at, host, f"worker on host {host} exited with "
                                   f"{w.describe_exit()}", w.failed_by_peer)
    return None


def _running(state: SliceState, view: ClusterView, now: float, spec: JobSpec,
             actions: list[Action]) -> SliceState:
    # Every tick: each member's record is looked up once, here (a pass over
    # 10,000 members takes 13-28 ms on this machine, bench/controller_costs.py).
    failures = []
    members: list[HostRecord] = []  # (all of them, in rank order, when none failed)
    done = 0
    first_step_at = None
    hosts, generation = view.hosts, state.generation
    for host, incarnation in zip(state.members, state.incarnations):
        record = hosts.get(host)
        failure = _member_failure(state, record, host, incarnation)
        if failure:
            failures.append(failure)
            continue
        members.append(record)
        w = record.worker
        if w.generation == generation:
            done += w.succeeded
            if w.step >= 0:
                at = record.first_step_at
                first_step_at = at if first_step_at is None else min(first_step_at, at)
    if first_step_at is not None and not state.progressed:
        step = min(r.worker.step for r in members
                   if r.worker.generation == generation and r.worker.step >= 0)
        began = state.restart_began if state.restart_began is not None else state.phase_since
        actions.append(Journal("first_progress", state.generation,
                               f"first step reported (step {step})", None,
                               {"step": step, "after_start_s": round(now - state.phase_since, 3),
                                "restart_cost_s": round(now - began, 3)}))
        state = _enter(state, Phase.RUNNING, now, f"generation {state.generation} running on "
                       f"{len(state.members)} hosts", progressed=True,
                       failures_without_progress=crash_loop.on_first_step(state),
                       restart_began=None,
                       restart_costs_s=grow.remember_cost(state.restart_costs_s, now - began))
    if failures:
        # A member whose connection closed (its agent died: its worker did,
        # and the peers' collectives abort) is the likelier root cause than a
        # peer's exit reported in the same instant.
        failed = {f.host for f in failures}
        failures += [blame.MemberFailure(at, host, f"host {host} disconnected (its agent's "
                                                   f"stream closed)")
                     for host in state.members
                     if host not in failed and (at := view.disconnected.get(host)) is not None]
        declared = [r.host_id for r in members if r.worker.generation == generation
                    and r.worker.running and r.worker.failure_cause == "own"]
        found = blame.culprit(failures, declared, len(failures) < len(state.members), now)
        if found.waiting:
            return state if state.reason == found.why else dataclasses.replace(state,
                                                                                reason=found.why)
        if (why := drain.member_left(view, found.hosts, found.why)) is not None:
            # leaving anyway: no failure (budget, crash loop) and no quarantine
            return _begin_stop(state, view, now, spec, actions, "preemption", why, ())
        return _begin_stop(state, view, now, spec, actions, "failure", found.why, found.hosts,
                           view.hosts.keys() - state.lost)
    carried = sum(h in state.carried for h in state.members) if state.carried else 0
    if done == len(state.members) or (carried and done and done + carried == len(state.members)):
        reason = f"all {done} workers of generation {state.generation} exited 0"
        if done < len(state.members):
            reason = (f"{done} of the {len(state.members)} workers of generation "
                      f"{state.generation} exited 0; the others' agents are silent "
                      f"({', '.join(sorted(state.carried))}), and their workers went through "
                      f"every step of the program with them")
        # (rank 0's report, unless its agent is the silent one)
        last = next(view.hosts[h].worker for h in state.members if h not in state.carried)
        actions.append(Journal("job_succeeded", state.generation, reason, None,
                               {"step": last.step, "metrics": dict(last.metrics)}))
        actions.append(Finish(0))
        return _enter(state, Phase.SUCCEEDED, now, reason, exit_code=0)
    # A hang first: a slice draining for a preemption whose worker is stuck
    # will never write its emergency checkpoint. But once it has, the workers
    # wait at the preemption sync point by design, and the hang clock, no
    # longer extended for a save in flight, may run out in the very pass that
    # sees the commit (tests/test_gcs.py under load: an emergency save that
    # waited 6.6 s for an earlier one committed 10.3 s after the last step).
    # (A carried member's step reports stopped with its agent; the others'
    # steps time the slice.)
    hang = check_hang([r for r in members if r.host_id not in state.carried], view,
                      state.phase_since, state.progressed, now, spec)
    leaving = [r for r in members if r.preemption]
    if leaving and (not hang or state.draining_since is not None
                    and drain.emergency_committed(view, state.draining_since)):
        # (wait for the emergency checkpoint, then stop: elastic.policy.drain)
        state, why = drain.verdict(state, view, now, spec, leaving)
        return state if why is None else _begin_stop(state, view, now, spec, actions,
                                                     "preemption", why, ())
    if hang:
        actions.append(Journal("hang_detected", state.generation, hang.reason,
                               hang.suspects[0] if hang.suspects else None,
                               {"suspects": list(hang.suspects), "blamed": list(hang.blamed),
                                "silent_s": round(hang.silent_s, 3),
                                "timeout_s": round(hang.timeout_s, 3)}))
        return _begin_stop(state, view, now, spec, actions, "failure", f"hang: {hang.reason}",
                           hang.blamed, view.hosts.keys() - state.lost, dump_stacks=True)
    return _consider_grow(state, view, now, spec, actions)


def _done(record: HostRecord, state: SliceState) -> bool:
    """Whether `record`'s worker of the current generation exited 0."""
    return record.worker.generation == state.generation and record.worker.succeeded


def _consider_grow(state: SliceState, view: ClusterView, now: float, spec: JobSpec,
                   actions: list[Action]) -> SliceState:
    """Whether a plan with the hosts there are now puts more devices in the
    mesh than the running slice (another host, or hosts with more devices:
    a repaired chip); if so, stop for a grow when `restart.grow` says, unless
    training is done: a worker said so (`worker_finishing`) or a member's
    worker of this generation exited 0. Notes
    the hosts such a plan leaves out. Planning is skipped (O(members), or
    O(hosts) without a sort) while nothing could make a bigger slice."""
    if state.phase is not Phase.RUNNING:
        return state
    members = frozenset(state.members)
    if len(view.hosts) <= len(members) and \
            all(view.hosts[h].devices <= state.devices_per_host for h in members):
        return _no_grow(state)
    candidates = [candidate(r) for r in view.hosts.values()
                  if r.host_id in members or usable(r, state, view)]
    if len(members) >= spec.max_hosts and \
            all(c.devices <= state.devices_per_host for c in candidates):
        return _no_grow(state)  # spares at max_hosts
    plan = plan_mesh(spec, candidates)
    state = _note_left_out(state, plan, actions, members)
    policy = spec.restart.grow
    if policy == "never" or plan.devices <= len(state.members) * state.devices_per_host:
        return _no_grow(state)
    if any(view.hosts[h].finishing_generation == state.generation or _done(view.hosts[h], state)
           for h in members if h in view.hosts):
        # training is done (its last checkpoint may be what commits now): a
        # grow would only restart a slice to restore and exit at once
        return _no_grow(state)
    ready_since = state.grow_ready_since if state.grow_ready_since is not None else now
    state = dataclasses.replace(state, grow_ready_since=ready_since)
    if policy == "after_checkpoint" and view.committed_at <= ready_since:
        return state
    rank0 = view.hosts[state.members[0]].worker
    devices_now = len(state.members) * state.devices_per_host
    pays, weighed = grow.grow_pays(devices_now, plan.devices, rank0.step,
                                   rank0.metrics.get("steps_total"),
                                   view.step_time(rank0), state.restart_costs_s)
    if not pays:
        if state.grow_declined != plan.devices:
            actions.append(Journal("grow_declined", state.generation,
                                   f"no grow from {devices_now} to {plan.devices} devices: "
                                   f"{weighed}", None,
                                   {"devices": devices_now, "devices_after": plan.devices}))
        return dataclasses.replace(state, grow_declined=plan.devices)
    why = (f"grow from {len(state.members)} to {len(plan.hosts)} hosts"
           + (f" ({plan.devices_per_host} devices each)"
              if plan.devices_per_host != state.devices_per_host else "")
           + (f" after checkpoint step {view.committed_step}"
              if policy == "after_checkpoint" else "")
           + f" ({weighed})")
    return _begin_stop(state, view, now, spec, actions, "grow", why, ())


def _no_grow(state: SliceState) -> SliceState:
    """`state` with no grow pending."""
    return dataclasses.replace(state, grow_ready_since=None) \
        if state.grow_ready_since is not None else state


def _begin_stop(state: SliceState, view: ClusterView, now: float, spec: JobSpec,
                actions: list[Action], kind: str, why: str, blamed: tuple[str, ...],
                usable: Set[str] = frozenset(), dump_stacks: bool = False) -> SliceState:
    """Stop every member. Failures (and preemptions, whose workers wait idle
    after their emergency save) stop with SIGKILL at once; grows get
    health.stop_grace_s, cut short once the emergency checkpoint the SIGTERM
    set off has committed (see _stopping). A failure is attributed to the `blamed` hosts
    (`usable`: the hosts the controller knows and has not lost, for quarantine).
    `dump_stacks` (a hang): every member's agent reports its worker's stacks first."""
    grace = spec.health.stop_grace_s if kind == "grow" else 0.0
    step = crash_loop.reached(state, view)
    progressed, changes = crash_loop.on_stop(state, kind, step)
    # (the journal's reader counts the crash loop from `progressed` and `step`)
    fields = {"cause": kind, "grace_s": grace, "blamed": list(blamed),
              "progressed": progressed, "step": step}
    actions.append(Journal("slice_stopping", state.generation, why,
                           blamed[0] if blamed else None, fields))
    for member in state.members:
        actions.append(StopWorker(member, state.generation, grace, why, dump_stacks))
    changes.update(draining_since=None, stop_hurried=False,
                   restart_began=now if state.restart_began is None else state.restart_began)
    if kind == "failure":
        failures, quarantined, newly = quarantine.record_failures(
            state.host_failures, state.quarantined, blamed, now, spec, why, usable)
        changes.update(host_failures=failures, quarantined=quarantined)
        # A failure that sets its host aside starts the crash-loop count again:
        # the next slice is another one, without that host (with the defaults both
        # limits are 3, and a host failing at every start — one that joined by a
        # grow, say — would otherwise fail a job whose other hosts are healthy).
        # Bounded: each quarantine needs min_hosts left outside it, and the
        # restart budget still counts every failure.
        if newly:
            changes["failures_without_progress"] = 0
        for host, reason in newly:
            actions.append(Journal("host_quarantined", state.generation, reason, host,
                                   {"until_s": round(quarantined[host][0] - now, 3)}))
    return _enter(state, Phase.STOPPING, now, why, stop_kind=kind,
                  stop_deadline=now + spec.health.stop_timeout_s, **changes)


def _stopped(record: HostRecord | None, state: SliceState, incarnation: str) -> bool:
    if record is None or record.host_id in state.lost or record.incarnation != incarnation:
        return True
    return record.worker.generation != state.generation or not record.worker.running


def _stopping(state: SliceState, view: ClusterView, now: float, spec: JobSpec,
              actions: list[Action]) -> SliceState:
    pending = [h for h, inc in zip(state.members, state.incarnations)
               if not _stopped(view.get(h), state, inc)]
    if pending and state.stop_kind == "grow" and not state.stop_hurried \
            and drain.emergency_committed(view, state.phase_since):
        # The workers saved at JAX's preemption sync point and now only wait.
        for host in pending:
            actions.append(StopWorker(host, state.generation, 0.0,
                                      f"emergency checkpoint step {view.emergency_save_step} "
                                      f"committed"))
        state = dataclasses.replace(state, stop_hurried=True)
    if pending and (ended := closed.after_a_peer_ended(state, view, now, pending)):
        state, pending = closed.lose(state, view, now, actions, pending, ended), []
    if pending and now < state.stop_deadline:
        return state
    for host in pending:
        actions.append(Journal("host_dropped", state.generation,
                               f"no stop acknowledgement within "
                               f"{spec.health.stop_timeout_s:g} s", host))
    actions.append(Journal("slice_stopped", state.generation,
                           f"generation {state.generation} stopped ({state.reason})", None,
                           {"cause": state.stop_kind,
                            "stop_s": round(now - state.phase_since, 3),
                            "dropped": pending}))
    state = fencing.fence_lost_slice(state, view, now, spec, actions, pending)
    if state.stop_kind != "failure":
        return _enter(state, Phase.WAITING, now, f"restarting: {state.reason}",
                      restarts=state.restarts + 1)
    # (a failure restart counts from when its stop began, as the journal's
    # slice_stopping has it: elastic.policy.failure_history)
    recent = failure_history.recent(state.failure_restarts, now, spec) + (state.phase_since,)
    spent = failure_history.exhausted(state.failures_without_progress, recent, spec)
    if spent:
        return _fail(state, now, actions, f"{spent}; last: {state.reason}")
    return _enter(state, Phase.WAITING, now, f"restarting after failure: {state.reason}",
                  failure_restarts=recent, restarts=state.restarts + 1)


def _fail(state: SliceState, now: float, actions: list[Action], reason: str) -> SliceState:
    actions.append(Journal("job_failed", state.generation, reason))
    actions.append(Finish(1))
    return _enter(state, Phase.FAILED, now, reason, exit_code=1)

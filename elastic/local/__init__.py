"""`elasticd local`: a controller and N agents as separate processes on this
machine, simulated hosts for trying a job and for tests.

Layout under the state directory: `events.jsonl` (the journal),
`controller.log`, `hosts/<host-id>.log` (each agent and its worker's
output), `hosts/<host-id>/dev` (its device nodes, see elastic.simdevices),
`local.json` (controller address and every agent's command line and
pid, for tools and tests that act on the slice).

The controller and agents share this launcher's process group; each worker
has its own (the agent's). SIGINT/SIGTERM stops the agents first (they end
their workers), then the controller; nothing is left behind. They also die
with the launcher, even when it is killed with SIGKILL (PR_SET_PDEATHSIG;
elastic.procs.spawn_bound), and what cannot die with it is recorded and
removed by the next run (elastic.local.leftovers).

With `isolate`, every host and the controller run in namespaces of their
own (elastic.local.network): an address each on a private bridge, a private
/dev/shm, and a disk of their own, `hosts/<host-id>/` (agent state, device
nodes, executable cache, tmp); the rest of the state directory is hidden
from them. Checkpoints then live in the GCS emulator's bucket, reached over
the bridge.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from elastic import simdevices
from elastic.config import JobSpec
from elastic.checkpoint.emulator import free_port
from elastic.controller.journal import read_journal
from elastic.controller.server import ADDRESS_FILE
from elastic.chaos import STORAGE_KINDS, Chaos, ChaosSpec
from elastic.faults import Fault
from elastic.local import leftovers, network
from elastic.local.controllers import (STANDBY_DIR, ControllerRestarts, controller_running,
                                       job_code, journal_dir, kill_controller,
                                       launch_controller, restart_controller, spawn_controller)
from elastic.local.console import JournalFollower, progress_line
from elastic.local.slice import LOCAL_FILE, LocalSlice, child_env, write_local_file
from elastic.procs import signal_pid, spawn_bound
from elastic.report import summarize
from elastic.security import allow, certs
from elastic.security.files import open_private, private_dir, write_private
from elastic.security.identity import Role
from elastic.security.tls import TLSFiles

TLS_DIR = "tls"


def _literal(text: str) -> str:
    """`text` as an allow-list pattern matching only itself."""
    return re.sub(r"([*?[])", r"[\1]", text)


def allow_args(spec: JobSpec, path: str) -> list[str]:
    """The allow-list flags of a simulated host's agent: exactly the job's
    command head (program resolved on `path`, the real path of the script
    in the job's workdir, or `-m module`), the workdir's real path for
    `-m`, and the variables of the job's env (the spec is the operator's
    own)."""
    argv, workdir = list(spec.command), spec.workdir
    resolved = allow.resolve(argv, workdir, lambda name: shutil.which(name, path=path))
    if isinstance(resolved, str):  # not on the PATH: the agent will say so at the start
        resolved = argv
    # (a path through /proc as given: the agent refuses it at the start, saying why)
    resolved = [t if t is not None else a for t, a in zip(resolved, argv)]
    if resolved[1:2] == ["-m"]:
        head = resolved[:3]  # program -m module
    elif len(resolved) > 1 and not resolved[1].startswith("-"):
        head = resolved[:2]  # program script
    else:
        head = resolved[:1]
    args = ["--allow-worker", shlex.join(_literal(t) for t in head),
            "--allow-workdir", _literal(os.path.realpath(workdir))]
    for name in spec.env:
        args += ["--allow-env", _literal(name)]
    return args


def host_dir(state_dir: pathlib.Path, host_id: str) -> pathlib.Path:
    """A simulated host's own directory: its device nodes, and when
    isolated its whole disk (agent state, executable cache, tmp)."""
    return state_dir / "hosts" / host_id


def agent_argv(address: str, host_id: str, failure_domain: str,
               state_dir: pathlib.Path, spec: JobSpec, insecure: bool = False,
               metadata_url: str | None = None,
               compile_cache_dir: pathlib.Path | None = None,
               net: network.NetworkPlan | None = None, metrics: bool = False,
               shared_cache: str | None = None,
               shared_cache_key: pathlib.Path | None = None,
               pin_job: bool = True) -> list[str]:
    """The command line of one simulated host's agent: its device nodes in
    STATE_DIR/hosts/HOST/dev (elastic.simdevices; counted like a real
    host's, kind "cpu"), its own certificate bundle under STATE_DIR/tls
    (or --insecure) and an allow-list of exactly the job's command
    (`allow_args`). `metadata_url` may hold "{host}", replaced by the host
    id (one fake metadata path per host). The executable cache is
    `compile_cache_dir`, default STATE_DIR/compile-cache, and the hosts
    also share `shared_cache` (a gs:// URL: the emulator's bucket) if given,
    its entries signed with the key in the file `shared_cache_key`.
    With `net`, the
    agent runs in the host's namespaces (`isolated_argv`), at its address,
    with its state and its executable cache on its own disk. Every agent
    serves health and reflection on a port of its own (`--listen ADDR:0`);
    with `metrics`, Prometheus metrics too (`--metrics-port 0`); both ports
    reach the controller (elasticd status shows them). With `pin_job`
    (default) the agent follows only the spec's job (`--job-id`); without,
    any job's controller at `address`, one job after another, as a
    deployment's agents do (README: Deployment)."""
    own = host_dir(state_dir, host_id)
    if net is not None:
        agent_state, cache = own / "agent", own / "compile-cache"
    else:
        agent_state = state_dir / "agents" / host_id
        cache = compile_cache_dir or state_dir / "compile-cache"
    host = net.address(host_id) if net else "127.0.0.1"
    argv = [sys.executable, "-m", "elastic.agent.main", "--controller", address,
            "--host-id", host_id, "--address", host, "--listen", f"{host}:0",
            *(["--metrics-port", "0"] if metrics else []),
            "--device-dir", str(simdevices.device_dir(state_dir, host_id)),
            "--device-kind", "cpu",
            "--failure-domain", failure_domain,
            *(["--job-id", spec.job_id] if pin_job else []),
            # when the slice is taken down, workers get the job's own grace
            # for planned stops (a worker that saved its emergency checkpoint
            # waits to be killed), not an agent's default of 5 s
            "--stop-grace-s", f"{spec.health.stop_grace_s:g}",
            "--state-dir", str(agent_state),
            # shared: one machine's simulated hosts share one executable
            # cache, as the hosts of a cluster may share one on a common
            # filesystem; isolated: each host has its own
            "--compile-cache-dir", str(cache),
            *(["--shared-compile-cache", shared_cache,
               "--shared-compile-cache-key", str(shared_cache_key)] if shared_cache else []),
            *allow_args(spec, child_env()["PATH"])]
    tls_dir = certs.bundle_dir(state_dir / TLS_DIR, Role.HOST, host_id)
    argv += ["--insecure"] if insecure else ["--tls-dir", str(tls_dir)]
    if metadata_url:
        argv += ["--gce-metadata", metadata_url.replace("{host}", host_id)]
    if net is None:
        return argv
    return isolated_argv(net, host_id, argv, state_dir,
                         keep=[own] + ([] if insecure else [tls_dir]))


def isolated_argv(net: network.NetworkPlan, node: str, argv: list[str],
                  state_dir: pathlib.Path, keep: list[pathlib.Path] | None = None) -> list[str]:
    """`argv` in `node`'s namespaces (elastic.local.network.wrap), with
    TMPDIR on its own disk. With `keep`, the state directory is hidden but
    for those directories (a host); without, it stays visible (the
    controller writes the journal there)."""
    etc_hosts = private_dir(state_dir / "net") / f"{node}.hosts"
    write_private(etc_hosts, network.hosts_file(net, node).encode())
    etc_hosts.chmod(0o644)
    if keep is None:
        return network.wrap(net, node, argv, etc_hosts)
    tmp = host_dir(state_dir, node) / "tmp"
    private_dir(tmp)
    return network.wrap(net, node, ["env", f"TMPDIR={tmp}", *argv], etc_hosts,
                        hide=state_dir, keep=keep)


def lasting_port(host: str = "127.0.0.1") -> int:
    """A TCP port of `host` free now and below this machine's ephemeral
    range (/proc/sys/net/ipv4/ip_local_port_range), so that no outgoing
    connection takes it as its source port after its listener has exited;
    0 (any) when none is found in 100 tries."""
    try:
        low = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(100):
        port = random.randrange(10000, max(10001, low))
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return port
    return 0


def host_devices(hosts: int, devices_per_host: int | Sequence[int]) -> list[int]:
    """Each simulated host's device count: one count for all, or one per
    host. Raises ValueError when a list's length is not `hosts` or a count
    is not from 1 to 256."""
    counts = [devices_per_host] * hosts if isinstance(devices_per_host, int) \
        else list(devices_per_host)
    if len(counts) != hosts:
        raise ValueError(f"{len(counts)} device counts for {hosts} hosts; give one count, or "
                         f"one per host")
    if not all(1 <= n <= 256 for n in counts):
        raise ValueError(f"device counts must be from 1 to 256, got {counts}")
    return counts


def start_slice(spec_path: str, spec: JobSpec, hosts: int,
                devices_per_host: int | Sequence[int], state_dir: pathlib.Path,
                metadata_url: str | None = None, insecure: bool = False,
                checkpoint_dir: str | None = None,
                extra_env: dict[str, str] | None = None,
                compile_cache_dir: pathlib.Path | None = None,
                net: network.NetworkPlan | None = None, standby: bool = False,
                metrics_port: int | None = None, shared_cache: str | None = None,
                shared_cache_key: pathlib.Path | None = None,
                pin_job: bool = True) -> LocalSlice:
    """Issue a throwaway CA and bundles under STATE_DIR/tls (unless
    `insecure`), start the controller, wait for its address, then start
    `hosts` agents, each with `devices_per_host` devices (one count, or
    one per host: a host with a failed chip has fewer). `checkpoint_dir`
    replaces the spec's; `extra_env` is added to every process's
    environment; `compile_cache_dir` is the hosts' executable cache
    (default: one under the state dir, new each run; isolated hosts have
    their own, which starts as a copy of `compile_cache_dir` if given).
    With `net` (made by the caller: network.create), the controller and
    each host run in their namespaces on that network. With `standby`, a
    second controller waits as a standby on another loopback port
    (elastic.controller.leadership) and agents are given both addresses.
    `metrics_port`: where the controller (the one leading) serves its
    Prometheus metrics (elastic.controller.metrics). `shared_cache`: an
    executable cache every host shares besides its own (agent_argv), signed
    with the key in the file `shared_cache_key` (each host gets a copy on
    its own disk; required with `shared_cache`). `pin_job`: see
    `agent_argv` (elastic.local.controllers.start_next_job runs another job
    on agents that are not pinned).
    Every process started dies with this one (spawn_bound).

    Raises RuntimeError when the controller exits or does not listen within
    30 s (its log says why); NotADirectoryError / PermissionError when the
    state directory cannot be made private; ValueError for bad device counts."""
    counts = host_devices(hosts, devices_per_host)
    private_dir(state_dir)
    private_dir(state_dir / "hosts")
    (state_dir / ADDRESS_FILE).unlink(missing_ok=True)
    host_ids = [f"host-{i}" for i in range(hosts)]
    if net is not None and compile_cache_dir is not None and compile_cache_dir.is_dir():
        for host_id in host_ids:  # each its own copy: a disk that kept its cache
            own_cache = host_dir(state_dir, host_id) / "compile-cache"
            if not own_cache.exists():
                shutil.copytree(compile_cache_dir, own_cache)
    tls = None
    if insecure:
        security = ["--insecure"]
        shutil.rmtree(state_dir / TLS_DIR, ignore_errors=True)  # no stale CA for the tools
    else:
        pki = certs.local_pki(state_dir / TLS_DIR, host_ids)
        security = ["--tls-dir", str(certs.bundle_dir(pki, Role.CONTROLLER, "localhost"))]
        tls = TLSFiles.in_dir(certs.bundle_dir(pki, Role.OPERATOR, "local"))
    extra_env = dict(extra_env or {})
    env = {**child_env(), **extra_env}
    host = net.address(network.CONTROLLER) if net else "127.0.0.1"
    # Agents that outlive the controller dial its port for the next job's:
    # one outside the ephemeral range, which any connection's source port
    # may take once the controller has exited (a deployment's is 7470).
    listen = f"{host}:{0 if pin_job or net else lasting_port(host)}"
    argv = [sys.executable, "-m", "elastic.cli", "start", "--config", spec_path,
            "--listen", listen, "--state-dir", str(state_dir), *security,
            *(["--checkpoint-dir", checkpoint_dir] if checkpoint_dir else []),
            *(["--metrics-port", str(metrics_port)] if metrics_port is not None else []),
            # the hosts it launches may register seconds apart on a busy machine
            "--expect-hosts", str(hosts)]
    plain = argv
    if net is not None:
        argv = isolated_argv(net, network.CONTROLLER, argv, state_dir)
    controller, address = spawn_controller(argv, state_dir, env)
    controller_argv = [address if arg == listen else arg for arg in argv]
    standby_proc, standby_argv, addresses, other = None, [], address, ""
    shares = standby and not (checkpoint_dir or spec.checkpoint_dir or "").startswith("gs://")
    if standby:
        # on its own node when isolated (any port is free there)
        other = f"{net.address(network.STANDBY)}:7470" if net is not None else \
            f"127.0.0.1:{free_port()}"  # (elastic.checkpoint.emulator's)
        standby_argv = [other if arg == listen else arg for arg in plain] + ["--standby"]
        if not shares:
            # controllers that share only the bucket: a state dir of its own
            # (elastic.controller.bucket_lease); the journal follows the lease
            own = private_dir(state_dir / STANDBY_DIR)
            standby_argv[standby_argv.index("--state-dir") + 1] = str(own)
        if net is not None:
            standby_argv = isolated_argv(net, network.STANDBY, standby_argv, state_dir)
        standby_proc = launch_controller(standby_argv, state_dir, env)
        addresses = f"{address},{other}"
    per_domain = spec.hosts_per_failure_domain
    host_key: dict[str, pathlib.Path] = {}
    if shared_cache:  # each host's copy on its own disk (all an isolated host sees)
        if shared_cache_key is None:
            raise ValueError("a shared executable cache needs its signing key file")
        for host_id in host_ids:
            host_key[host_id] = private_dir(host_dir(state_dir, host_id)) / "compile-cache.key"
            write_private(host_key[host_id], shared_cache_key.read_bytes())
    agents, argvs = {}, {}
    for i, host_id in enumerate(host_ids):
        simdevices.set_devices(simdevices.device_dir(state_dir, host_id), counts[i])
        argv = agent_argv(addresses, host_id, f"domain-{i // per_domain}",
                          state_dir, spec, insecure, metadata_url, compile_cache_dir, net,
                          metrics=metrics_port is not None, shared_cache=shared_cache,
                          shared_cache_key=host_key.get(host_id), pin_job=pin_job)
        out = open_private(state_dir / "hosts" / f"{host_id}.log", "ab")
        agents[host_id] = spawn_bound(argv, stdout=out, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=env)
        out.close()
        argvs[host_id] = argv
    local = LocalSlice(state_dir, controller, address, agents, argvs, tls,
                       spec.health.heartbeat_timeout_s, extra_env, net, controller_argv,
                       standby=standby_proc, standby_argv=standby_argv, standby_address=other,
                       standby_shares_state_dir=shares, addresses=addresses)
    write_local_file(local)
    return local


def _terminate(procs: list[subprocess.Popen], timeout_s: float,
               sig: int = signal.SIGTERM) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def stop_slice(local: LocalSlice, agent_grace_s: float = 10.0) -> None:
    """Stop the controller first (so it does not treat the workers' ends as
    failures to recover from), then the agents (SIGINT: they end their
    workers, no preemption drain), including agents that `elasticd chaos`
    started again (listed in local.json). Bounded."""
    if local.standby is not None:  # first, so that it does not take over
        _terminate([local.standby], 5.0)
    _terminate([local.controller], 5.0)
    _terminate(list(local.agents.values()), agent_grace_s, signal.SIGINT)
    ours = {p.pid for p in local.agents.values()}
    try:
        listed = json.loads((local.state_dir / LOCAL_FILE).read_text())["agents"]
    except (OSError, ValueError, KeyError):
        listed = {}
    others = [a["pid"] for a in listed.values() if a.get("pid") and a["pid"] not in ours]
    for pid in others:
        signal_pid(pid, signal.SIGINT)
    deadline = time.monotonic() + agent_grace_s
    for pid in others:
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.05)
        signal_pid(pid, signal.SIGKILL)
    # a host killed by a fault and not started again left its snapshots in memory
    leftovers.remove_snapshot_dirs(local.state_dir)


def restart_agent(local: LocalSlice, host_id: str) -> bool:
    """Start `host_id`'s agent again (a host that comes back), same command
    line; False (nothing done) while the old agent process cannot be reaped
    yet: still running, or still being torn down (its main thread already a
    zombie in /proc while the kernel ends its other threads)."""
    old = local.agents.get(host_id)
    if old is not None and old.poll() is None:
        return False
    if old is not None:
        old.wait()
    out = open_private(local.state_dir / "hosts" / f"{host_id}.log", "ab")
    local.agents[host_id] = spawn_bound(local.agent_argv[host_id], stdout=out,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env={**child_env(), **local.extra_env})
    out.close()
    write_local_file(local)
    return True


def run_chaos(state_dir: str, chaos: ChaosSpec, duration_s: float | None,
              tls: TLSFiles | None) -> int:
    """`elasticd chaos`: random faults on the local slice running in
    `state_dir` (from its local.json) for `duration_s` seconds (None: until
    SIGINT/SIGTERM or until `chaos.count` faults). Agents it starts again are
    recorded in local.json, so that the launcher stops them at the end."""
    state = pathlib.Path(state_dir).resolve()
    info = json.loads((state / LOCAL_FILE).read_text())
    started: list[subprocess.Popen] = []

    def restart(host_id: str) -> None:
        argv = info["agents"][host_id]["argv"]
        out = open_private(state / "hosts" / f"{host_id}.log", "ab")
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL,
                                env={**child_env(), **info.get("extra_env", {})},
                                start_new_session=True)
        out.close()
        started.append(proc)
        info["agents"][host_id]["pid"] = proc.pid
        write_private(state / LOCAL_FILE, json.dumps(info, indent=2).encode())

    timeout = float(info.get("heartbeat_timeout_s", 5.0))
    chaos_thread = Chaos(chaos, info["controller"], tls, state, restart,
                         lambda h: info["agents"][h]["pid"], timeout)
    received: list[int] = []
    old = {s: signal.signal(s, lambda signum, frame: received.append(signum))
           for s in (signal.SIGINT, signal.SIGTERM)}
    chaos_thread.start()
    deadline = time.monotonic() + duration_s if duration_s else float("inf")
    try:
        while not received and chaos_thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        chaos_thread.stop()
        for s, handler in old.items():
            signal.signal(s, handler)
    print(f"elasticd chaos: {chaos_thread.injected} fault(s) injected", flush=True)
    return 0


def wants_storage_faults(faults: list[Fault] | None, chaos: ChaosSpec | None) -> bool:
    """Whether planned or random faults include a storage kind (which needs
    the storage proxy in front of the emulator)."""
    kinds = {f.kind for f in faults or ()} | set(chaos.kinds if chaos else ())
    return bool(kinds & set(STORAGE_KINDS))


@dataclasses.dataclass
class Surroundings:
    """What a local slice runs in (see `surroundings`): the isolated network
    (None: the root namespace), the checkpoint directory replacing the
    spec's (None: the spec's), the executable cache the hosts share
    besides their own (the bucket's `compile-cache/`; None: none) and the
    file of the key that signs its entries (made with the bucket), the
    variables every process gets (the
    emulator's), and the storage fault proxy (None: no storage faults)."""

    net: network.NetworkPlan | None = None
    checkpoint_dir: str | None = None
    shared_cache: str | None = None
    shared_cache_key: pathlib.Path | None = None
    extra_env: dict[str, str] = dataclasses.field(default_factory=dict)
    proxy: Any = None


@contextlib.contextmanager
def surroundings(state: pathlib.Path, job_id: str, hosts: int, isolate: bool,
                 gcs_emulator: bool, storage_faults: bool = False,
                 quiet: bool = False, standby: bool = False) -> Iterator[Surroundings]:
    """Make what a local slice of `hosts` hosts runs in, and remove it on
    exit: with `isolate`, the network of elastic.local.network (recorded in
    leftovers.json before it is made); with `gcs_emulator`, or `isolate`
    (isolated hosts share no directory), fake-gcs-server and the bucket
    `elastic-local` (checkpoints under `job_id`), on the network's gateway
    when isolated; with `storage_faults` too, the fault
    proxy in front of it; with `isolate` and `standby`, a node for a standby
    controller on the network. Prints what it made unless `quiet`. Makes
    `state` (private) if needed. Raises network.IsolationError when the
    network cannot be made, RuntimeError when the emulator does not start."""
    say = (lambda text: None) if quiet else (lambda text: print(text, flush=True))
    made = Surroundings()
    emulator = None
    private_dir(state)
    try:
        if isolate:
            made.net = network.new_plan([f"host-{i}" for i in range(hosts)],
                                        network.used_networks(), standby)
        leftovers.record(state, made.net)  # before anything is made
        if made.net is not None:
            network.create(made.net)
            say(f"elasticd local: isolated hosts on {made.net.prefix}.0/24 "
                f"(bridge {made.net.bridge})")
        if gcs_emulator or isolate:
            from elastic.checkpoint.emulator import GCSEmulator

            log = open_private(state / "gcs-emulator.log", "ab")
            emulator = GCSEmulator(made.net.gateway if made.net else "127.0.0.1").start(log=log)
            log.close()
            bucket = emulator.create_bucket("elastic-local")
            made.checkpoint_dir = f"{bucket}/{job_id}"
            # hosts that share nothing else share executables through it
            made.shared_cache = f"{bucket}/compile-cache"
            made.shared_cache_key = state / "compile-cache.key"
            write_private(made.shared_cache_key, os.urandom(32))
            made.extra_env = emulator.env
            say(f"elasticd local: GCS emulator at {emulator.url}, checkpoints in "
                f"{made.checkpoint_dir}")
            if storage_faults:
                from elastic.checkpoint.faulty_storage import FaultProxy

                made.proxy = FaultProxy(emulator.url, host=emulator.host).start()
                made.extra_env = made.proxy.env  # the controller and every host go through it
                say(f"elasticd local: storage faults through a proxy at {made.proxy.url}")
        yield made
    finally:
        if made.proxy is not None:
            made.proxy.stop()
        if emulator is not None:
            emulator.stop()
        if made.net is not None:
            left = network.destroy(made.net)
            if left:
                print(f"elasticd local: could not remove {', '.join(left)}; "
                      f"`elasticd local --cleanup --state-dir {state}` will", file=sys.stderr)
        if not (made.net and network.exists(made.net)):
            (state / leftovers.RECORD).unlink(missing_ok=True)


def run_local(spec_path: str, spec: JobSpec, hosts: int,
              devices_per_host: int | Sequence[int],
              state_dir: str, quiet: bool = False, faults: list[Fault] | None = None,
              progress_every_s: float = 5.0, metadata_url: str | None = None,
              chaos: ChaosSpec | None = None, insecure: bool = False,
              gcs_emulator: bool = False, compile_cache_dir: str | None = None,
              isolate: bool = False, standby: bool = False,
              metrics_port: int | None = None) -> int:
    """Run the job on `hosts` simulated hosts until it ends or a signal comes,
    injecting the planned `faults` and random `chaos` faults on the way;
    prints a summary at the end. Mutual TLS with a throwaway CA unless
    `insecure`. `gcs_emulator`: start fake-gcs-server for this run and keep
    the checkpoints in its bucket `elastic-local`, under the job id; with
    storage faults planned or drawn (storage-slow, storage-outage), the
    controller and hosts reach it through a fault proxy.
    `compile_cache_dir`: an executable cache kept across runs (isolated
    hosts each start with a copy of it, as hosts whose disks kept theirs).
    `isolate`: hosts and controller in namespaces of their own
    (elastic.local.network), with the emulator on the network's gateway
    (as if `gcs_emulator`). What a killed earlier run in `state_dir` left
    is removed first (elastic.local.leftovers). `standby`: a second
    controller waits as a standby (on a node of its own with `isolate`;
    elastic.local.controllers). `metrics_port`: the controller's
    Prometheus metrics endpoint (see start_slice).

    Returns the controller's exit code (0 succeeded, 1 failed), 128 + N
    after signal N (SIGINT, SIGTERM, SIGHUP: the terminal went away).
    Raises NotADirectoryError when `state_dir` is a file, RuntimeError
    when the earlier run still runs, the network cannot be made
    (network.IsolationError) or the controller does not start."""
    state = private_dir(pathlib.Path(state_dir).resolve())
    leftovers.cleanup(state)
    follower = None if quiet else JournalFollower([state, state / STANDBY_DIR])
    if follower:
        follower.start()
    received: list[int] = []

    def on_signal(signum, frame) -> None:
        received.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM,
                                                    signal.SIGHUP)}
    stack = contextlib.ExitStack()
    local = injector = None
    try:
        around = stack.enter_context(surroundings(
            state, spec.job_id, hosts, isolate, gcs_emulator, wants_storage_faults(faults, chaos),
            standby=standby))
        local = start_slice(spec_path, spec, hosts, devices_per_host, state, metadata_url,
                            insecure, around.checkpoint_dir, around.extra_env,
                            pathlib.Path(compile_cache_dir).resolve()
                            if compile_cache_dir else None, around.net, standby,
                            metrics_port, around.shared_cache, around.shared_cache_key)
        counts = host_devices(hosts, devices_per_host)
        devices = (f"{counts[0]} devices" if len(set(counts)) == 1
                   else f"{'/'.join(map(str, counts))} devices")
        print(f"elasticd local: controller at {local.address}, {hosts} hosts x "
              f"{devices}, state in {state}", flush=True)
        if faults or chaos:
            injector = Chaos(chaos, local.addresses, local.tls, state,
                             lambda h: restart_agent(local, h),
                             lambda h: local.agents[h].pid, spec.health.heartbeat_timeout_s,
                             planned=faults, storage=around.proxy, network=around.net,
                             controller=(lambda: kill_controller(local),
                                         lambda: restart_controller(local)))
            injector.start()
        live = sys.stdout.isatty()
        next_line = time.monotonic() + (0.5 if live else progress_every_s)
        restarts = ControllerRestarts(local)
        while not received:
            for line in restarts.poll():
                print(("\n" if live and not quiet else "") + f"elasticd local: {line}",
                      flush=True)
            if not controller_running(local):
                break
            time.sleep(0.05)
            if not quiet and time.monotonic() >= next_line:
                next_line = time.monotonic() + (0.5 if live else progress_every_s)
                # on a terminal one line updated in place; otherwise plain lines
                print(("\r\033[K" if live else "") + progress_line(local.address, local.tls),
                      end="" if live else "\n", flush=True)
        code = job_code(local)
        stop_slice(local, agent_grace_s=spec.health.stop_grace_s + 5.0)
        if received:
            return 128 + received[0]
        return local.controller.wait() if code is None else code
    finally:
        if injector is not None:
            injector.stop()
        if local is not None:
            stop_slice(local)
        stack.close()  # the emulator, the proxy, the network
        if follower:
            follower.stop()
        if not quiet:
            print(summarize(read_journal(journal_dir(state))), flush=True)
        for s, handler in old.items():
            signal.signal(s, handler)

"""Simulated hosts that share nothing but a network (`elasticd local --isolate`).

Each simulated host, and the controller, runs in a network namespace of its
own joined to a private bridge by a veth pair, and in a mount namespace of
its own with a private /dev/shm, its own /etc/hosts and host name, and its
own disk: the run's state directory is hidden behind an empty tmpfs and only
the host's own directory (and its certificate bundle) is put back. What a
host can reach of another is its address, as on a cluster.

Addresses, for a run tagged T with prefix P (a free 10.213.X.0/24):
the bridge `elbT` in the root namespace holds P.1, the gateway: the runner,
the GCS emulator and its fault proxy listen there. Node k of the plan (the
controller first, then the hosts) lives in namespace `elastic-T-<node>` at
P.(2 + k), behind the root-side link `elvTk`; inside it is `eth0`.

Network faults act on those links (the kernel here has no netem; see
docs/isolation.md): a cut link (`ip link set down`) is a full partition,
blackhole routes on both sides cut chosen pairs, and `tbf` on both ends of
a veth throttles a host's link.

Everything here runs `ip`, `tc`, `mount` and friends from util-linux and
iproute2, as root. Side effects only; the plan itself is pure data.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import pathlib
import re
import secrets
import shlex
import shutil
import subprocess
from collections.abc import Sequence

#: 10.213.X.0/24 networks are tried in order, skipping any the machine uses.
SUBNET_BASE = (10, 213)
MAX_NODES = 250
CONTROLLER = "controller"
#: A standby controller's node (elasticd local --isolate --standby).
STANDBY = "standby"
#: Seconds any one `ip`/`tc` command may take.
COMMAND_TIMEOUT_S = 10.0

_TOOLS = ("ip", "tc", "unshare", "mount", "setpriv")  # setpriv: elastic.procs


class IsolationError(RuntimeError):
    """A namespace, link, route or qdisc could not be made or changed; the
    message names the command and what it printed."""


@dataclasses.dataclass(frozen=True)
class NetworkPlan:
    """Names and addresses of one isolated run: `tag` (5 hex digits),
    `prefix` ("10.213.X"), `nodes` (the controller, a standby controller if
    there is one, then the hosts)."""

    tag: str
    prefix: str
    nodes: tuple[str, ...]

    @property
    def bridge(self) -> str:
        return f"elb{self.tag}"

    @property
    def gateway(self) -> str:
        """The root namespace's address on the bridge (runner, emulator)."""
        return f"{self.prefix}.1"

    def index(self, node: str) -> int:
        try:
            return self.nodes.index(node)
        except ValueError:
            raise KeyError(f"no node {node!r} in this network (nodes: "
                           f"{', '.join(self.nodes)})") from None

    def namespace(self, node: str) -> str:
        self.index(node)
        return f"elastic-{self.tag}-{node}"

    def address(self, node: str) -> str:
        return f"{self.prefix}.{2 + self.index(node)}"

    def root_link(self, node: str) -> str:
        """The root-namespace end of `node`'s veth pair (at most 15 chars)."""
        return f"elv{self.tag}{self.index(node)}"

    def hosts(self) -> list[str]:
        return [n for n in self.nodes if n not in (CONTROLLER, STANDBY)]

    def to_json(self) -> dict:
        return {"tag": self.tag, "prefix": self.prefix, "nodes": list(self.nodes)}

    @classmethod
    def from_json(cls, data: dict) -> "NetworkPlan":
        return cls(str(data["tag"]), str(data["prefix"]), tuple(map(str, data["nodes"])))


def choose_prefix(used: Sequence[ipaddress.IPv4Network]) -> str:
    """The first 10.213.X (X from 0 to 255) whose /24 overlaps none of
    `used`. Raises IsolationError when all are taken."""
    a, b = SUBNET_BASE
    for x in range(256):
        net = ipaddress.ip_network(f"{a}.{b}.{x}.0/24")
        if not any(net.overlaps(u) for u in used):
            return f"{a}.{b}.{x}"
    raise IsolationError(f"no free {a}.{b}.X.0/24 network on this machine")


def new_plan(hosts: Sequence[str], used: Sequence[ipaddress.IPv4Network],
             standby: bool = False) -> NetworkPlan:
    """A plan for the controller (and a standby controller, with `standby`)
    and `hosts` on a free /24 with a fresh tag. Raises ValueError for more
    than MAX_NODES nodes or a bad host name."""
    nodes = (CONTROLLER, *((STANDBY,) if standby else ()), *hosts)
    if len(nodes) > MAX_NODES:
        raise ValueError(f"--isolate runs at most {MAX_NODES - 1} hosts, not {len(hosts)}")
    bad = [h for h in hosts if not re.fullmatch(r"[a-z0-9-]{1,40}", h)
           or h in (CONTROLLER, STANDBY)]
    if bad:
        raise ValueError(f"host names {bad} cannot name network namespaces")
    return NetworkPlan(secrets.token_hex(3)[:5], choose_prefix(used), nodes)


def capability_problem() -> str | None:
    """One line saying why isolated hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "--isolate needs root (network and mount namespaces)"
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if missing:
        return f"--isolate needs {', '.join(missing)} (iproute2, util-linux), not found"
    if not os.path.isdir("/proc/self/ns") or not os.path.exists("/proc/self/ns/net"):
        return "--isolate needs network namespaces, which this kernel does not offer"
    return None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise IsolationError(f"`{shlex.join(argv)}` took over {COMMAND_TIMEOUT_S:g} s") from None
    if check and done.returncode != 0:
        raise IsolationError(f"`{shlex.join(argv)}` failed: "
                             f"{(done.stderr or done.stdout).strip()[:300]}")
    return done


def used_networks() -> list[ipaddress.IPv4Network]:
    """The IPv4 networks of this machine's addresses and routes."""
    nets = []
    for line in _run("ip", "-o", "-4", "addr", "show").stdout.splitlines() + \
            _run("ip", "-4", "route", "show", "table", "all").stdout.splitlines():
        for word in line.split():
            try:
                nets.append(ipaddress.ip_network(word, strict=False))
            except ValueError:
                continue
    return [n for n in nets if n.version == 4 and n.prefixlen > 0]


def create(plan: NetworkPlan) -> None:
    """Make the bridge, the namespaces and their links. Raises
    IsolationError naming the command that failed (what was made stays
    recorded in the plan; `destroy` removes it)."""
    _run("ip", "link", "add", plan.bridge, "type", "bridge")
    _run("ip", "addr", "add", f"{plan.gateway}/24", "dev", plan.bridge)
    _run("ip", "link", "set", plan.bridge, "up")
    for node in plan.nodes:
        ns, root, inner = plan.namespace(node), plan.root_link(node), f"elp{plan.tag}x"
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", root, "type", "veth", "peer", "name", inner)
        _run("ip", "link", "set", inner, "netns", ns)
        _run("ip", "-n", ns, "link", "set", inner, "name", "eth0")
        _run("ip", "-n", ns, "addr", "add", f"{plan.address(node)}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "link", "set", root, "master", plan.bridge)
        _run("ip", "link", "set", root, "up")


def namespace_pids(plan: NetworkPlan) -> list[int]:
    """Processes still inside any of the plan's namespaces."""
    pids = []
    for node in plan.nodes:
        out = _run("ip", "netns", "pids", plan.namespace(node), check=False).stdout
        pids += [int(p) for p in out.split() if p.isdigit()]
    return pids


def _namespaces() -> set[str]:
    return set(_run("ip", "netns", "list", check=False).stdout.split())


def _has_bridge(plan: NetworkPlan) -> bool:
    return _run("ip", "link", "show", plan.bridge, check=False).returncode == 0


def destroy(plan: NetworkPlan) -> list[str]:
    """Remove the namespaces (their veth pairs go with them) and the bridge;
    whatever is already gone is skipped. Returns what could not be removed
    (empty when everything is gone)."""
    left = []
    existing = _namespaces()
    for node in plan.nodes:
        ns = plan.namespace(node)
        if ns in existing and _run("ip", "netns", "del", ns, check=False).returncode != 0:
            left.append(f"network namespace {ns}")
        _run("ip", "link", "del", plan.root_link(node), check=False)
    if _has_bridge(plan) and _run("ip", "link", "del", plan.bridge, check=False).returncode != 0:
        left.append(f"bridge {plan.bridge}")
    return left


def exists(plan: NetworkPlan) -> bool:
    """Whether any namespace or the bridge of `plan` is still there."""
    existing = _namespaces()
    return any(plan.namespace(n) in existing for n in plan.nodes) or _has_bridge(plan)


def hosts_file(plan: NetworkPlan, node: str) -> str:
    """/etc/hosts inside `node`'s namespace: its own name resolves to its
    address (gloo, JAX's CPU collectives, advertises the address of the
    host name), and every other node by name."""
    lines = ["127.0.0.1 localhost"] + [f"{plan.address(n)} {n}" for n in plan.nodes]
    return "\n".join(lines) + "\n"


def wrap(plan: NetworkPlan, node: str, argv: Sequence[str], etc_hosts: pathlib.Path,
         hide: pathlib.Path | None = None, keep: Sequence[pathlib.Path] = ()) -> list[str]:
    """`argv` run inside `node`'s namespaces: its network namespace, a new
    UTS namespace with host name `node`, and a mount namespace with a fresh
    tmpfs on /dev/shm and `etc_hosts` on /etc/hosts. With `hide`, an empty
    tmpfs covers that directory and only the `keep` directories (inside it)
    come back, bound from the originals. The process keeps its pid (each
    step execs the next, so a PR_SET_PDEATHSIG set before stays set)."""
    q = shlex.quote
    script = ["set -e", f"hostname {q(node)}",
              "mount -t tmpfs -o mode=1777 elastic-shm /dev/shm",
              f"mount --bind {q(str(etc_hosts))} /etc/hosts"]
    if hide is not None:
        for fd, path in enumerate(keep, start=3):
            script.append(f"exec {fd}< {q(str(path))}")
        script.append(f"mount -t tmpfs -o mode=0700 elastic-hidden {q(str(hide))}")
        for fd, path in enumerate(keep, start=3):
            script += [f"mkdir -p {q(str(path))}",
                       f"mount --no-canonicalize --bind /proc/self/fd/{fd} {q(str(path))}",
                       f"exec {fd}<&-"]
    script.append(f"exec {shlex.join(argv)}")
    return ["ip", "netns", "exec", plan.namespace(node), "unshare", "--uts", "--",
            "sh", "-c", "\n".join(script)]


# --- network faults --------------------------------------------------------

def set_link(plan: NetworkPlan, node: str, up: bool) -> None:
    """Cut (`up=False`) or restore `node`'s only link: a full partition.
    Raises IsolationError when `ip` fails."""
    _run("ip", "link", "set", plan.root_link(node), "up" if up else "down")


def set_blocked(plan: NetworkPlan, node: str, others: Sequence[str], blocked: bool) -> None:
    """Drop (or let through again) all traffic between `node` and each of
    `others`, both ways: blackhole routes in both namespaces. Raises
    IsolationError when a route cannot be added (removal is best effort)."""
    verb = "add" if blocked else "del"
    for other in others:
        for a, b in ((node, other), (other, node)):
            _run("ip", "-n", plan.namespace(a), "route", verb, "blackhole",
                 f"{plan.address(b)}/32", check=blocked)


def set_rate(plan: NetworkPlan, node: str, rate_kbit: int | None) -> None:
    """Throttle `node`'s link to `rate_kbit` kbit/s both ways (tbf on both
    ends of its veth pair; bursts of 32 kbit, at most 400 ms queued), or
    lift the limit (None). Raises IsolationError when `tc` fails to set it."""
    for tc, dev in ((["tc"], plan.root_link(node)),
                    (["tc", "-n", plan.namespace(node)], "eth0")):
        if rate_kbit is None:
            _run(*tc, "qdisc", "del", "dev", dev, "root", check=False)
        else:
            _run(*tc, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_kbit}kbit",
                 "burst", "32kbit", "latency", "400ms")

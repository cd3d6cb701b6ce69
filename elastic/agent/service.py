"""The agent's own gRPC port (`elastic-agent --listen HOST:PORT`): the
host's logs for `elasticd logs` (elastic.agent.logs), replicas of its
peers' snapshots (elastic.agent.replicas), and the standard
health service and reflection (elastic.health), over mutual TLS with the
host's certificate, for probes (systemd, Kubernetes, a load balancer's
checks) and grpcurl. Services in grpc.health.v1:

  ""                        SERVING while the agent runs
  elastic.agent.Controller  SERVING while it has a session with a controller,
                            NOT_SERVING while it looks for one

Clients need a certificate of the job's CA (an operator bundle) and must
expect the server name `elastic-host` (HOST_SERVER_NAME), which host
certificates carry since they may serve this port; no host certificate
carries the controller's name, so none can stand in for a controller.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from elastic import transport
from elastic.agent.logs import LogsServicer
from elastic.agent.replicas import ReplicaReceiver, ReplicaStore
from elastic.health import NOT_SERVING, SERVING, add_health_and_reflection
from elastic.security.identity import Role
from elastic.security.tls import TLSFiles
from elastic.v1 import control_pb2_grpc as pb_grpc

log = logging.getLogger("elastic-agent")

#: The health service name that follows the agent's controller session.
SESSION_SERVICE = "elastic.agent.Controller"
#: The agent's gRPC service (its Logs call: elastic.agent.logs).
AGENT_SERVICE = "elastic.v1.Agent"


def can_serve(tls: TLSFiles) -> bool:
    """Whether the certificate in `tls` may serve TLS (serverAuth usage)."""
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    try:
        cert = x509.load_pem_x509_certificate(tls.cert.read_bytes())
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except (OSError, ValueError, x509.ExtensionNotFound):
        return True  # (no usage restriction, or unreadable: add_listen_port says why)
    return ExtendedKeyUsageOID.SERVER_AUTH in usage


class AgentServicer(LogsServicer, ReplicaReceiver):
    """The Agent service: Logs (elastic.agent.logs) and PutReplica
    (elastic.agent.replicas)."""

    def __init__(self, state_dir: str, replicas: Callable[[], ReplicaStore | None]) -> None:
        LogsServicer.__init__(self, state_dir)
        ReplicaReceiver.__init__(self, replicas)


class AgentService:
    """The agent's server: `await start()` (returns the port), `await
    session(up)` as its controller session opens and ends, `await stop()`.
    `replicas()` -> where peers' snapshot replicas go (None: refused)."""

    def __init__(self, listen: str, tls: TLSFiles | None, state_dir: str,
                 replicas: Callable[[], ReplicaStore | None] = lambda: None) -> None:
        self.listen, self.tls = listen, tls
        self.server = transport.aio_server()
        pb_grpc.add_AgentServicer_to_server(AgentServicer(state_dir, replicas), self.server)
        self.health = add_health_and_reflection(self.server, [AGENT_SERVICE])
        self.port = 0

    async def start(self) -> int:
        """Listen and serve. Raises RuntimeError when the address cannot be
        bound, TLSError when the host's files cannot serve."""
        if self.tls is not None and not can_serve(self.tls):
            log.warning("%s has no serverAuth usage (issued before agents served a port): "
                        "probes and elasticd logs will fail the TLS handshake against port %s "
                        "until the host gets a new certificate", self.tls.cert, self.listen)
        self.port = transport.add_listen_port(self.server, self.listen, self.tls,
                                              roles=(Role.HOST,))
        await self.server.start()
        await self.health.set("", SERVING)
        await self.health.set(SESSION_SERVICE, NOT_SERVING)
        return self.port

    async def session(self, up: bool) -> None:
        await self.health.set(SESSION_SERVICE, SERVING if up else NOT_SERVING)

    async def stop(self) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(1.0)


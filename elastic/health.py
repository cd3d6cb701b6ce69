"""gRPC health checking (grpc.health.v1, grpcio-health-checking) and server
reflection (grpcio-reflection) on the controller's and the agents' servers,
so that standard tools work against them over the job's mutual TLS:

    grpc_health_probe -addr HOST:7470 -tls -tls-ca-cert ca.pem \\
        -tls-client-cert cert.pem -tls-client-key key.pem -tls-server-name elastic-controller
    grpcurl -cacert ca.pem -cert cert.pem -key key.pem \\
        -authority elastic-controller HOST:7470 list

(any certificate of the job's CA: an operator bundle, `elasticd certs
issue --role operator`). The service "" is SERVING while the process
serves; see the callers for their named services.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def add_health_and_reflection(server: grpc.aio.Server,
                              services: list[str]) -> health.aio.HealthServicer:
    """Add the health service and reflection (listing `services`, full
    names, and the two added) to `server` before it starts. Returns the
    health servicer: `await it.set(name, SERVING | NOT_SERVING)`."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = [*services, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    return servicer

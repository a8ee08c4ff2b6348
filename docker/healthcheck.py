"""Container health check: asks the server's grpc.health.v1 service; exit 0 when SERVING.

Environment:
    NLMSERVE_PORT: the gRPC port (default 50051); NLMSERVE_HEALTH_HOST the host (default 127.0.0.1).
    NLMSERVE_TLS_CA: PEM CA of the server certificate: check over TLS (a server started with
        --tls-cert serves TLS only). NLMSERVE_TLS_CERT / NLMSERVE_TLS_KEY: a client certificate
        for a server that requires one (--tls-client-ca). NLMSERVE_TLS_SERVER_NAME: the name in
        the server certificate when it is not the host (e.g. the certificate names the service).
The health service stays open on a server with --token-file: no token is sent.
"""

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVICE = "nlmserve.v1.LanguageModel"


def _read(variable: str) -> bytes | None:
    path = os.environ.get(variable)
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def channel(target: str) -> grpc.Channel:
    try:
        ca, cert, key = _read("NLMSERVE_TLS_CA"), _read("NLMSERVE_TLS_CERT"), _read("NLMSERVE_TLS_KEY")
    except OSError as exc:
        raise SystemExit(f"unhealthy: cannot read {exc.filename}: {exc.strerror}") from exc
    if ca is None and cert is None:
        return grpc.insecure_channel(target)
    name = os.environ.get("NLMSERVE_TLS_SERVER_NAME")
    options = [("grpc.ssl_target_name_override", name)] if name else []
    credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    return grpc.secure_channel(target, credentials, options=options)


def main() -> int:
    target = f"{os.environ.get('NLMSERVE_HEALTH_HOST', '127.0.0.1')}:{os.environ.get('NLMSERVE_PORT', '50051')}"
    try:
        with channel(target) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=2.0)
    except grpc.RpcError as exc:
        print(f"unhealthy: {exc.code().name}", file=sys.stderr)
        return 1
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    print("SERVING" if serving else health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())

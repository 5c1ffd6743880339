"""Control-plane security: a shared token on every call (constant-time check) and optional TLS."""

from __future__ import annotations

import collections
import hmac
import secrets
from dataclasses import dataclass
from pathlib import Path

import grpc

from cluster.config import ConfigError
from cluster.doors import is_unix_target
from cluster.taskenv import TOKEN_ENV, env_token

METADATA_KEY = "authorization"


@dataclass(frozen=True)
class Credentials:
    """What both ends of the control plane need: the token, and TLS material if TLS is on."""

    token: str
    tls_cert: str = ""  # server certificate (PEM path); with tls_key, the server speaks TLS
    tls_key: str = ""
    tls_ca: str = ""  # the CA clients trust (PEM path); defaults to tls_cert (self-signed)

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert or self.tls_ca)

    @property
    def trusted_ca(self) -> str:
        """The CA a client trusts ("" without TLS): tls_ca, else the (self-signed) certificate."""
        return (self.tls_ca or self.tls_cert) if self.tls else ""


def load_token(token_file: str = "", generate: bool = False) -> str:
    """The token from a file, else $PSTRAIN_TOKEN, else a fresh random one where allowed."""
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as e:
            raise ConfigError(f"cluster.token_file: cannot read {token_file} ({e.strerror}); give a readable file") from None
        if not token:
            raise ConfigError(f"cluster.token_file: {token_file} is empty; put a shared secret in it")
        return token
    token = env_token()
    if token:
        return token
    if generate:
        return secrets.token_urlsafe(24)
    raise ConfigError(f"--token-file: no token; pass --token-file or set {TOKEN_ENV} to the cluster's shared token")


def token_matches(expected: str, metadata) -> bool:
    presented = dict(metadata or ()).get(METADATA_KEY, "")
    return hmac.compare_digest(presented.encode(), f"Bearer {expected}".encode())


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuse every call whose token is missing or wrong, before any handler runs."""

    def __init__(self, token: str):
        self._token = token

        def deny(_request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong pstrain token")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):
        if token_matches(self._token, handler_call_details.invocation_metadata):
            return continuation(handler_call_details)
        return self._deny


def _read(path: str, field: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{field}: cannot read {path} ({e.strerror}); give a PEM file") from None


def server_credentials(creds: Credentials) -> grpc.ServerCredentials | None:
    if not creds.tls_cert:
        return None
    if not creds.tls_key:
        raise ConfigError("cluster.tls_key: a TLS certificate needs its key; set tls_key or remove tls_cert")
    pair = (_read(creds.tls_key, "cluster.tls_key"), _read(creds.tls_cert, "cluster.tls_cert"))
    return grpc.ssl_server_credentials([pair])


def channel(address: str, creds: Credentials) -> grpc.Channel:
    """A channel to the control plane that sends the token on every call."""
    call_creds = grpc.metadata_call_credentials(lambda _ctx, callback: callback(((METADATA_KEY, f"Bearer {creds.token}"),), None))
    if creds.tls and not is_unix_target(address):  # a unix socket is served without TLS (`serve`)
        root = _read(creds.tls_ca or creds.tls_cert, "cluster.tls_ca")
        return grpc.secure_channel(address, grpc.composite_channel_credentials(grpc.ssl_channel_credentials(root), call_creds))
    # Without TLS gRPC refuses call credentials; attach the token as plain metadata instead.
    return grpc.intercept_channel(grpc.insecure_channel(address), _TokenClientInterceptor(creds.token))


class _CallDetails(
    collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
    grpc.ClientCallDetails,
):
    pass


class _TokenClientInterceptor(grpc.UnaryUnaryClientInterceptor):
    def __init__(self, token: str):
        self._metadata = ((METADATA_KEY, f"Bearer {token}"),)

    def intercept_unary_unary(self, continuation, details, request):
        metadata = tuple(details.metadata or ()) + self._metadata
        new = _CallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready, details.compression
        )
        return continuation(new, request)

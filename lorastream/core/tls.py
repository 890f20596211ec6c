"""TLS material for the gRPC servers and clients: read once at startup, checked, named by flag.

Every server (store, worker, gateway) takes ``--tls-cert`` / ``--tls-key`` and, for mutual TLS,
``--tls-client-ca`` (the CA whose certificates it accepts; a client without one is refused).
Every client takes a CA to trust (``--tls-ca``, or ``--store-tls-ca`` / ``--worker-tls-ca`` on
the hops of a service) and, for mutual TLS, its own certificate and key (``--tls-client-cert``,
``--tls-client-key``, same prefixes). The files are read and checked here with the standard
``ssl`` module, so a wrong path, a key that does not match its certificate or a file that is not
PEM stops the process at once with one line naming the flag; the PEM bytes then travel as plain
values (a :class:`ClientTLS` is pickled to the worker's fetch process).
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from lorastream.core.errors import InvalidArgument


def _read(path: Path, flag: str) -> bytes:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise InvalidArgument(f"{flag} {path}: no such file") from None
    except OSError as err:
        raise InvalidArgument(f"{flag} {path}: cannot read it ({err.strerror})") from None
    if b"-----BEGIN " not in data:
        raise InvalidArgument(f"{flag} {path}: not a PEM file (expected -----BEGIN ...)")
    return data


def _check_pair(cert: Path, key: Path, cert_flag: str, key_flag: str) -> None:
    """InvalidArgument unless ``cert`` is a certificate and ``key`` its private key."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(cert, key)
    except ssl.SSLError as err:
        raise InvalidArgument(
            f"{cert_flag} {cert} / {key_flag} {key}: not a certificate and its private key "
            f"({err.reason or err})"
        ) from None


def _check_ca(path: Path, flag: str) -> bytes:
    data = _read(path, flag)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=data.decode())
    except (ssl.SSLError, UnicodeDecodeError) as err:
        raise InvalidArgument(f"{flag} {path}: not a PEM CA certificate ({err})") from None
    return data


def _pair(cert: Path | None, key: Path | None, cert_flag: str,
          key_flag: str) -> tuple[bytes, bytes] | None:
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        given, missing = (cert_flag, key_flag) if key is None else (key_flag, cert_flag)
        raise InvalidArgument(f"{given} needs {missing} as well (a certificate and its key)")
    cert_pem, key_pem = _read(cert, cert_flag), _read(key, key_flag)
    _check_pair(cert, key, cert_flag, key_flag)
    return cert_pem, key_pem


@dataclass(frozen=True, repr=False)
class ServerTLS:
    """A server's certificate chain and key (PEM), and the CA its clients must present a
    certificate from (None: any client may connect, as over plain TLS)."""

    cert: bytes
    key: bytes
    client_ca: bytes | None = None

    def __repr__(self) -> str:  # never a key in a log line
        return f"ServerTLS(mutual={self.client_ca is not None})"

    @classmethod
    def from_files(
        cls, cert: Path | None, key: Path | None, client_ca: Path | None = None
    ) -> ServerTLS | None:
        """The server TLS of ``--tls-cert``/``--tls-key``/``--tls-client-ca``; None when none
        is given (plaintext). InvalidArgument naming the flag on anything missing or wrong."""
        pair = _pair(cert, key, "--tls-cert", "--tls-key")
        if pair is None:
            if client_ca is not None:
                raise InvalidArgument(
                    "--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)"
                )
            return None
        ca = _check_ca(client_ca, "--tls-client-ca") if client_ca is not None else None
        return cls(pair[0], pair[1], ca)

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )


@dataclass(frozen=True, repr=False)
class ClientTLS:
    """What a client trusts (a CA, PEM; None: the system's roots) and, for mutual TLS, the
    certificate and key it presents."""

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None

    def __repr__(self) -> str:
        return f"ClientTLS(ca={self.ca is not None}, mutual={self.cert is not None})"

    @classmethod
    def from_files(
        cls, ca: Path | None, cert: Path | None = None, key: Path | None = None, *,
        prefix: str = "--",
    ) -> ClientTLS | None:
        """The client TLS of ``{prefix}tls-ca``/``{prefix}tls-client-cert``/
        ``{prefix}tls-client-key`` (``prefix`` ``--store-``: the worker's flags to its store);
        None when none is given (plaintext)."""
        pair = _pair(cert, key, f"{prefix}tls-client-cert", f"{prefix}tls-client-key")
        if ca is None and pair is None:
            return None
        ca_pem = _check_ca(ca, f"{prefix}tls-ca") if ca is not None else None
        return cls(ca_pem, *(pair or (None, None)))

    def grpc_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


# Every channel keeps its connections to itself (gRPC's default pools them process-wide, keyed
# by address and options). With the shared pool, a channel opened to a server that restarted at
# the address of one that died (a store pod back on its IP, a test server on a recycled port)
# inherits the dead one's failed connection and its reconnect backoff: its first calls fail at
# once with "Connection refused" while the new server is up. Also grpc/grpc#38327: the shared
# pool keeps state for channels long closed.
OWN_CONNECTIONS = ("grpc.use_local_subchannel_pool", 1)


def channel_options(options: Sequence[tuple[str, object]] = ()) -> list[tuple[str, object]]:
    """``options`` with :data:`OWN_CONNECTIONS` unless they set the pool themselves."""
    if any(name == OWN_CONNECTIONS[0] for name, _ in options):
        return list(options)
    return [*options, OWN_CONNECTIONS]


def open_channel(
    target: str, tls: ClientTLS | None, options: Sequence[tuple[str, object]] = ()
) -> grpc.Channel:
    """A blocking channel to ``target``: over TLS with ``tls``, else plaintext; its connections
    its own (:data:`OWN_CONNECTIONS`)."""
    if tls is None:
        return grpc.insecure_channel(target, options=channel_options(options))
    return grpc.secure_channel(target, tls.grpc_credentials(), options=channel_options(options))


def open_aio_channel(
    target: str, tls: ClientTLS | None, options: Sequence[tuple[str, object]] = (),
    server_name: str | None = None,
) -> grpc.aio.Channel:
    """An asyncio channel to ``target``: over TLS with ``tls``, else plaintext; its connections
    its own (:data:`OWN_CONNECTIONS`). ``server_name``: the name the server's certificate must
    be valid for, when ``target`` is an address resolved from it (a pod IP behind a headless
    Service); by default the host of ``target``."""
    if tls is None:
        return grpc.aio.insecure_channel(target, options=channel_options(options))
    if server_name is not None:
        options = [*options, ("grpc.ssl_target_name_override", server_name)]
    credentials = tls.grpc_credentials()
    return grpc.aio.secure_channel(target, credentials, options=channel_options(options))


def https_context(
    ca: Path | None, cert: Path | None = None, key: Path | None = None
) -> ssl.SSLContext:
    """An ``ssl`` context for an HTTPS client (httpx ``verify=``) trusting ``ca`` (None: the
    system's roots) and presenting ``cert``/``key`` when given (mutual TLS)."""
    context = ssl.create_default_context(cafile=str(ca) if ca is not None else None)
    if cert is not None:
        context.load_cert_chain(cert, key)
    return context

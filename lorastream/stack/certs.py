"""A throwaway certificate authority and the certificates of a local stack (`lorastream up --tls`).

``make_local_certs(directory)`` writes, into a directory only its owner can enter (0700, keys
0600): a CA, one server certificate (every service presents it; SAN ``localhost`` and
``127.0.0.1``) and one client certificate (every client presents it for mutual TLS), all signed
by that CA. Nothing outside the directory trusts the CA; it lives as long as the stack. Tests use
``make_ca`` and ``issue`` to make a second, unrelated CA.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOCAL_HOSTS = ("localhost", "127.0.0.1")
_VALIDITY = datetime.timedelta(days=30)


@dataclass(frozen=True)
class CertAuthority:
    """A CA's certificate (``cert``, PEM file) and its signing key, kept in memory only."""

    cert: Path
    certificate: x509.Certificate
    key: ec.EllipticCurvePrivateKey


@dataclass(frozen=True)
class LocalCerts:
    """The PEM files of a local stack's TLS."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: Path, data: bytes, mode: int) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as file:
        file.write(data)
    return path


def make_ca(directory: Path, name: str = "lorastream local CA",
            file_name: str = "ca.pem") -> CertAuthority:
    """A new self-signed CA named ``name``; its certificate is written to
    ``directory/file_name``."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(_name(name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                          content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=False, encipher_only=False,
                          decipher_only=False),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    path = _write(directory / file_name, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return CertAuthority(path, cert, key)


def issue(
    ca: CertAuthority, directory: Path, name: str, *, hosts: Sequence[str] = LOCAL_HOSTS,
    client: bool = False,
) -> tuple[Path, Path]:
    """A certificate for ``name`` signed by ``ca`` (a server's, valid for ``hosts``; with
    ``client``, a client's) and its key, written to ``directory/<name>.pem`` and
    ``directory/<name>-key.pem`` (0600); returns their paths."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(ca.certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()),
            critical=False,
        )
    )
    if not client:
        names: list[x509.GeneralName] = []
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(ca.key, hashes.SHA256())
    cert_path = _write(directory / f"{name}.pem", cert.public_bytes(serialization.Encoding.PEM),
                       0o644)
    key_path = _write(
        directory / f"{name}-key.pem",
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                          serialization.NoEncryption()),
        0o600,
    )
    return cert_path, key_path


def make_local_certs(directory: Path, hosts: Sequence[str] = LOCAL_HOSTS) -> LocalCerts:
    """A fresh CA, a server certificate for ``hosts`` and a client certificate, in
    ``directory`` (created, or narrowed, to mode 0700)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory.chmod(0o700)
    ca = make_ca(directory)
    server_cert, server_key = issue(ca, directory, "server", hosts=hosts)
    client_cert, client_key = issue(ca, directory, "client", client=True)
    return LocalCerts(ca.cert, server_cert, server_key, client_cert, client_key)

"""A throwaway TLS certificate for tests against a server on 127.0.0.1 (made by the openssl CLI,
which scripts/bootstrap installs)."""

import pathlib
import shutil
import subprocess


def self_signed_certificate(directory: pathlib.Path):
    """(server.pem, server.key) in `directory`: a one-day self-signed certificate for
    127.0.0.1, which is also the CA a client trusts."""
    openssl = shutil.which("openssl")
    assert openssl, "openssl is installed by scripts/bootstrap"
    cert, key = directory / "server.pem", directory / "server.key"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key

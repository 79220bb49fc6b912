"""A self-signed certificate for tests of HTTPS, made with the ``openssl`` command."""

from __future__ import annotations

import subprocess
from pathlib import Path

from actors.serving.frontend import TlsFiles


def self_signed(folder: Path) -> TlsFiles:
    """A certificate for 127.0.0.1 and localhost, valid for a day, and its key, in ``folder``
    (the ``openssl`` command makes them: Debian's base image has it)."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    args = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
    args += ["-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost"]
    args += ["-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"]
    subprocess.run(args, check=True, capture_output=True, timeout=60)
    return TlsFiles(str(cert), str(key))

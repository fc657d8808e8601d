"""The job secret: what lets the parts of one job trust each other's control messages.

Every job has a secret of 256 bits. The user gives it (``PHALANX_SECRET``, or
``PHALANX_SECRET_FILE`` naming a file only its owner can read, e.g. on a shared filesystem), or
node 0's launcher makes one at random and hands it to its own workers through their environment,
never on a command line or in a log. A control message is *sealed*: it travels with a fresh
nonce and an HMAC-SHA256 over the place it is meant for (a store key or queue), the nonce and the
message; :meth:`JobSecret.open` checks the HMAC in constant time and refuses anything else, and
a :class:`NonceLedger` refuses a sealed message seen before (a replay). The same seal serves the
control messages (JSON) and torch's rendezvous values (:mod:`phalanx.comm.sealed_store`): nothing
read from the network is unpickled on the strength of a seal.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

from phalanx.errors import AuthenticationError, ConfigurationError

SECRET_ENV = "PHALANX_SECRET"
SECRET_FILE_ENV = "PHALANX_SECRET_FILE"
SECRET_BYTES = 32


class JobSecret:
    """The job's key; seals and opens control messages (see the module's docstring)."""

    def __init__(self, key: bytes):
        if len(key) < 16:
            raise ConfigurationError("a job secret needs at least 128 bits: give at least 32 hex digits.")
        self._key = key

    @classmethod
    def generate(cls) -> JobSecret:
        return cls(secrets.token_bytes(SECRET_BYTES))

    def hex(self) -> str:
        """The secret as text, for the environment of this node's own workers (never for a log)."""
        return self._key.hex()

    def seal(self, place: str, value: str | bytes) -> bytes:
        """``value`` bound to ``place``: a fresh 16-byte nonce, their 32-byte HMAC, the value."""
        data = value.encode() if isinstance(value, str) else bytes(value)
        nonce = secrets.token_bytes(16)
        return nonce + self._mac(place, nonce, data) + data

    def open(self, place: str, sealed: bytes) -> tuple[bytes, bytes]:
        """The value and its nonce, if ``sealed`` was sealed for ``place`` with this secret."""
        nonce, mac, value = sealed[:16], sealed[16:48], sealed[48:]
        if len(sealed) < 48 or not hmac.compare_digest(mac, self._mac(place, nonce, value)):
            raise AuthenticationError(f"the value at {place} does not carry the job's secret")
        return value, nonce

    def _mac(self, place: str, nonce: bytes, value: bytes) -> bytes:
        return hmac.new(self._key, place.encode() + b"\0" + nonce + value, hashlib.sha256).digest()


class NonceLedger:
    """The nonces already accepted: a sealed message comes once; the second time it is a replay."""

    def __init__(self) -> None:
        self._seen: set[bytes] = set()

    def first_time(self, nonce: bytes) -> bool:
        if nonce in self._seen:
            return False
        self._seen.add(nonce)
        return True


def from_environment(environ: dict[str, str] | os._Environ[str] = os.environ) -> JobSecret | None:
    """The secret the user gave (``PHALANX_SECRET`` or ``PHALANX_SECRET_FILE``), or None."""
    if environ.get(SECRET_ENV):
        return _parsed(environ[SECRET_ENV], SECRET_ENV)
    if environ.get(SECRET_FILE_ENV):
        return read_file(Path(environ[SECRET_FILE_ENV]))
    return None


def required(who: str, launch: str) -> JobSecret:
    """The job's secret for ``who`` (e.g. "an elastic worker"), which only exists under ``phalanx
    run``; without one, a :class:`ConfigurationError` saying to ``launch`` that way."""
    secret = from_environment()
    if secret is None:
        raise ConfigurationError(f"{who} needs the job's secret in {SECRET_ENV}, which phalanx run gives the "
                                 f"processes it starts: {launch}.")
    return secret


def read_file(path: Path) -> JobSecret:
    """The secret in ``path``, which must be a regular file only its owner can read or write."""
    try:
        info = path.stat()
        text = path.read_text().strip()
    except OSError as error:
        raise ConfigurationError(f"cannot read the job secret file {path}: {error.strerror}.") from error
    if not stat.S_ISREG(info.st_mode) or info.st_mode & 0o077:
        raise ConfigurationError(
            f"the job secret file {path} can be read or written by others (mode {stat.filemode(info.st_mode)}): "
            f"make it owner-only with `chmod 600 {path}`.")
    return _parsed(text, str(path))


def write_file(secret: JobSecret, directory: Path) -> Path:
    """Save ``secret`` in a new owner-only file in ``directory`` (made owner-only if new); its path."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / f"job-{secrets.token_hex(8)}.secret"
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(secret.hex() + "\n")
    return path


def _parsed(text: str, source: str) -> JobSecret:
    """Hex digits are the key itself; any other text of 16 characters or more is hashed into one."""
    text = text.strip()
    try:
        return JobSecret(bytes.fromhex(text))
    except (ValueError, ConfigurationError):
        if len(text) < 16:
            raise ConfigurationError(f"the job secret in {source} is too short: give at least 32 hex digits "
                                     "or 16 characters.") from None
        return JobSecret(hashlib.sha256(text.encode()).digest())

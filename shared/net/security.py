"""CURVE encryption and ZAP authentication for every downpour socket, and the key files.

Key directory (what ``downpour keygen DIR`` writes; the format is ``zmq.auth``'s Z85
certificates, so czmq/pyzmq tools read it)::

    DIR/server.key                  server public key: give it to every worker and reader
    DIR/server.key_secret           server secret key (mode 0600): the server only
    DIR/workers/NAME.key            worker public keys: the server's worker allow-list
    DIR/readers/NAME.key            status-reader public keys: the status allow-list
    DIR/clients/NAME.key_secret     a worker's or reader's secret key (0600): to NAME only

The server reads ``server.key_secret``, ``workers/`` and ``readers/`` (``--keys DIR``); a
client reads its own secret key and ``server.key`` (``--key``, ``--server-key``). A key's
name is its file name; it is the identity the server binds to the ``sender`` of a push.

Who may connect where (two ZAP domains):

- ``downpour`` (hello/weights REP, gradient PULL): worker keys only. A reader key cannot pull
  weights or push gradients.
- ``downpour-status`` (status REP): worker keys and reader keys. Monitoring gets its own
  keys so that a dashboard's key, if it leaks, cannot change or copy the model.

Every server socket sets ``ZAP_ENFORCE_DOMAIN``: if no ZAP handler answers, libzmq refuses
every CURVE client instead of letting them all in (its default). The handler is
``Authenticator``: our own REP socket on ``inproc://zeromq.zap.01`` in a thread, rather than
pyzmq's ThreadAuthenticator, because we need denial counts by reason, two allow-lists mapped
to names (returned as the ZAP User-Id) and an atomic reload on SIGHUP.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
from zmq.utils import z85

log = logging.getLogger("downpour.net.security")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
TRAINING_DOMAIN = "downpour"  # hello/weights REP and gradient PULL: workers only
STATUS_DOMAIN = "downpour-status"  # status REP: workers and status readers

SERVER_SECRET = "server.key_secret"
SERVER_PUBLIC = "server.key"
WORKERS_DIR = "workers"
READERS_DIR = "readers"
CLIENTS_DIR = "clients"

# auth_denied reasons (status document). R_IDENTITY is also a protocol rejection reason.
D_UNKNOWN_KEY = "unknown_key"  # a CURVE key on no allow-list
D_NOT_ALLOWED = "not_allowed"  # a known key on a socket it may not use (reader -> training)
D_MECHANISM = "mechanism"  # NULL or PLAIN client on a CURVE socket
D_HANDSHAKE = "handshake"  # other failed handshakes: a client with a wrong server key, a
# client that hung up mid-handshake (a NULL client noticing the mismatch first, a TCP probe)
D_BAD_REQUEST = "bad_request"  # a malformed ZAP request (should not happen)
R_IDENTITY = "identity"  # message sender differs from the name of its authenticated key

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# A key NAME may also speak as NAME/INSTANCE ("/" is not allowed in key names): one key shared
# by identical replicas (compose --scale, a Kubernetes Deployment), each its own worker id.
INSTANCE_SEPARATOR = "/"

# POSIX access ACL as Linux stores it (xattr system.posix_acl_access): a version, then
# (tag, perm, id) entries. systemd grants a service its credentials through such an entry.
_ACL_XATTR = "system.posix_acl_access"
_ACL_USER, _ACL_GROUP_OBJ, _ACL_GROUP, _ACL_MASK, _ACL_OTHER = 0x02, 0x04, 0x08, 0x10, 0x20


class SecurityError(Exception):
    """Keys are missing, malformed, too readable, or CURVE is unavailable.

    Recovery: none at run time; the message names the file or setting to fix, and the
    service refuses to start rather than run with weaker security than configured.
    """


@dataclass(frozen=True)
class KeyPair:
    """A CURVE key pair as Z85 bytes (40 characters each) and the name it was issued to."""

    public: bytes
    secret: bytes
    name: str = ""


@dataclass(frozen=True)
class AllowList:
    """Z85 public key -> name, for workers and for status readers."""

    workers: Mapping[bytes, str] = field(default_factory=dict)
    readers: Mapping[bytes, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ServerKeys:
    """What ``--keys DIR`` gives the server: its key pair and the allow-lists."""

    directory: Path
    keypair: KeyPair
    allow: AllowList


@dataclass(frozen=True)
class ClientKeys:
    """What a worker or status reader needs: its own key pair and the server's public key."""

    keypair: KeyPair
    server_public: bytes


# ---------------------------------------------------------------- key files


def require_curve() -> None:
    """Raise SecurityError unless this libzmq can do CURVE."""
    if not zmq.has("curve"):
        raise SecurityError(
            f"keys are configured but this libzmq {zmq.zmq_version()} was built without CURVE "
            "(zmq.has('curve') is False); install a pyzmq wheel, which bundles it"
        )


def check_name(name: str) -> str:
    """A key name is a file name and a worker id: letters, digits, '.', '_', '-'."""
    if not NAME_RE.match(name):
        raise SecurityError(f"bad key name {name!r}: use letters, digits, '.', '_', '-' (<= 64)")
    return name


def _certificate_text(public: bytes, secret: bytes | None, name: str) -> str:
    kind = "**Secret**" if secret else "Public"
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    lines = [
        f"#   ****  Generated on {now} by downpour keygen  ****",
        f"#   ZeroMQ CURVE {kind} Certificate",
        "#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions."
        if secret
        else "#   Exchange securely, or check its contents after the exchange.",
        "",
        "metadata",
        f'    name = "{name}"',
        "curve",
        f'    public-key = "{public.decode()}"',
    ]
    if secret:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


def write_certificate(path: Path, public: bytes, secret: bytes | None, name: str) -> Path:
    """Create a certificate file atomically; never overwrites an existing file.

    The file is written under a temporary name created with its final mode (0600 for a
    secret, 0644 for a public key), so a secret is never readable by others, not even
    briefly, and is hard-linked into place only when complete.
    """
    mode = 0o600 if secret else 0o644
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)  # the umask may only have removed bits; make it exact
        os.write(fd, _certificate_text(public, secret, name).encode())
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    try:
        os.link(tmp, path)  # atomic, and fails instead of replacing an existing key
    except FileExistsError:
        raise SecurityError(f"{path} exists; keys are never overwritten") from None
    finally:
        tmp.unlink(missing_ok=True)
    return path


def check_secret_permissions(path: Path) -> None:
    """Refuse a secret key file that group or others may access (like ssh does)."""
    try:
        mode = path.stat().st_mode  # follows symlinks: Kubernetes mounts secrets as links
    except OSError as exc:
        raise SecurityError(f"cannot read secret key {path}: {exc.strerror}") from None
    if mode & 0o077 and not (mode & 0o007 == 0 and _acl_private(path)):
        raise SecurityError(
            f"secret key {path} has mode {mode & 0o777:04o}: it must not be readable by group "
            f"or others. Run: chmod 600 {path}"
        )


def _acl_private(path: Path) -> bool:
    """True if the file's POSIX ACL lets nobody but its owner (root or us) and us access it.

    With an ACL the mode's group bits show the ACL mask, not the owning group: systemd's
    credentials (LoadCredential= on tmpfs) are 0400 plus ``user:SERVICE:r``, shown as 0440.
    """
    try:
        raw = os.getxattr(path, _ACL_XATTR)
        owner = path.stat().st_uid
    except OSError:
        return False
    if len(raw) < 12 or (len(raw) - 4) % 8 or struct.unpack_from("<I", raw)[0] != 2:
        return False
    entries = [struct.unpack_from("<HHI", raw, off) for off in range(4, len(raw), 8)]
    mask = next((perm for tag, perm, _ in entries if tag == _ACL_MASK), 0o7)
    me = os.geteuid()
    for tag, perm, ident in entries:
        if tag == _ACL_OTHER and perm:
            return False
        if tag in (_ACL_GROUP_OBJ, _ACL_GROUP) and perm & mask:
            return False
        if tag == _ACL_USER and perm & mask and ident != me:
            return False
    return owner in (0, me)


def read_certificate(path: Path, secret: bool = False) -> KeyPair:
    """Parse a Z85 certificate (zmq.auth format); with ``secret``, check mode and the secret."""
    path = Path(path)
    if secret:
        check_secret_permissions(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SecurityError(f"cannot read key file {path}: {exc}") from None
    values: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        values.setdefault(key.strip(), value.strip().strip("'\""))
    public = values.get("public-key", "").encode()
    secret_key = values.get("secret-key", "").encode()
    if not _valid_z85_key(public):
        raise SecurityError(f"{path}: no valid public-key (40 Z85 characters)")
    if secret:
        if not _valid_z85_key(secret_key):
            raise SecurityError(f"{path}: no valid secret-key; is this the .key_secret file?")
        if zmq.curve_public(secret_key) != public:
            raise SecurityError(f"{path}: the public key does not belong to the secret key")
    name = values.get("name") or path.name.removesuffix("_secret").removesuffix(".key")
    return KeyPair(public, secret_key if secret else b"", name)


def _valid_z85_key(key: bytes) -> bool:
    if len(key) != 40:
        return False
    try:
        return len(z85.decode(key)) == 32
    except (ValueError, KeyError):
        return False


def generate_keys(
    directory: str | os.PathLike[str], workers: Sequence[str], readers: Sequence[str] = ()
) -> list[Path]:
    """Create the server key pair (kept if it exists) and one key pair per worker and reader.

    Returns the files created. Existing client keys are never overwritten, so this also adds
    workers to a key directory (then SIGHUP the server).
    """
    names = [check_name(n) for n in [*workers, *readers]]
    if len(set(names)) != len(names):
        raise SecurityError(f"duplicate key names in {names}")
    d = Path(directory)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    for sub, mode in ((WORKERS_DIR, 0o755), (READERS_DIR, 0o755), (CLIENTS_DIR, 0o700)):
        (d / sub).mkdir(mode=mode, exist_ok=True)
    for group, members in ((WORKERS_DIR, workers), (READERS_DIR, readers)):
        for n in members:
            for p in (d / CLIENTS_DIR / f"{n}.key_secret", d / group / f"{n}.key"):
                if p.exists():
                    raise SecurityError(f"{p} exists; keys are never overwritten")
    created: list[Path] = []
    if not (d / SERVER_SECRET).exists():
        public, secret = zmq.curve_keypair()
        created.append(write_certificate(d / SERVER_SECRET, public, secret, "server"))
        created.append(write_certificate(d / SERVER_PUBLIC, public, None, "server"))
    for group, members in ((WORKERS_DIR, workers), (READERS_DIR, readers)):
        for n in members:
            public, secret = zmq.curve_keypair()
            created.append(
                write_certificate(d / CLIENTS_DIR / f"{n}.key_secret", public, secret, n)
            )
            created.append(write_certificate(d / group / f"{n}.key", public, None, n))
    return created


def _load_public_dir(directory: Path) -> dict[bytes, str]:
    keys: dict[bytes, str] = {}
    if not directory.is_dir():
        return keys
    for path in sorted(directory.glob("*.key")):
        name = check_name(path.name[: -len(".key")])
        kp = read_certificate(path)
        if kp.public in keys:
            raise SecurityError(f"{path}: same public key as {keys[kp.public]!r}")
        keys[kp.public] = name
    return keys


def load_allow_lists(directory: str | os.PathLike[str]) -> AllowList:
    """Read ``workers/*.key`` and ``readers/*.key``; a key's name is its file name."""
    d = Path(directory)
    workers = _load_public_dir(d / WORKERS_DIR)
    readers = _load_public_dir(d / READERS_DIR)
    both = set(workers) & set(readers)
    if both:
        raise SecurityError(f"{d}: a key is both a worker and a reader ({workers[both.pop()]})")
    return AllowList(workers, readers)


def load_server_keys(
    directory: str | os.PathLike[str], secret_file: str | os.PathLike[str] | None = None
) -> ServerKeys:
    """The server side of ``--keys DIR [--key FILE]``: checks CURVE and the secret's mode.

    The secret key is ``DIR/server.key_secret`` unless ``secret_file`` names another place
    (e.g. a systemd credential), so the allow-lists and the secret can be shipped apart.
    """
    require_curve()
    d = Path(directory)
    if not d.is_dir():
        raise SecurityError(f"--keys {d}: no such directory (create it with downpour keygen)")
    keypair = read_certificate(Path(secret_file) if secret_file else d / SERVER_SECRET, secret=True)
    allow = load_allow_lists(d)
    if not allow.workers:
        log.warning("no worker keys in %s: no worker can connect", d / WORKERS_DIR)
    return ServerKeys(d, keypair, allow)


def load_client_keys(
    key_file: str | os.PathLike[str], server_key_file: str | os.PathLike[str]
) -> ClientKeys:
    """A worker's or reader's own secret key file and the server's public key file."""
    require_curve()
    keypair = read_certificate(Path(key_file), secret=True)
    server = read_certificate(Path(server_key_file))
    return ClientKeys(keypair, server.public)


def client_keys_from_args(key: str | None, server_key: str | None) -> ClientKeys | None:
    """``--key``/``--server-key`` given together -> ClientKeys; neither -> None."""
    if not key and not server_key:
        return None
    if not key or not server_key:
        raise SecurityError("--key and --server-key go together (own secret key, server.key)")
    return load_client_keys(key, server_key)


# ---------------------------------------------------------------- sockets


def configure_curve_server(sock: zmq.Socket, keys: ServerKeys, domain: str) -> None:
    """Make ``sock`` a CURVE server in ZAP ``domain``, refusing all if no ZAP handler runs."""
    sock.curve_server = True
    sock.curve_secretkey = keys.keypair.secret
    sock.curve_publickey = keys.keypair.public
    sock.zap_domain = domain.encode()
    try:
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    except (AttributeError, zmq.ZMQError) as exc:
        raise SecurityError(f"libzmq {zmq.zmq_version()} cannot enforce ZAP: {exc}") from None


def configure_curve_client(sock: zmq.Socket, keys: ClientKeys) -> None:
    """Make ``sock`` a CURVE client with its own key pair, trusting the server's key."""
    sock.curve_secretkey = keys.keypair.secret
    sock.curve_publickey = keys.keypair.public
    sock.curve_serverkey = keys.server_public


def curve_client(keys: ClientKeys | None) -> Callable[[zmq.Socket], None] | None:
    """A ``ReqClient(configure=...)`` hook, so a recreated REQ socket is CURVE again."""
    if keys is None:
        return None
    return lambda sock: configure_curve_client(sock, keys)


def may_speak_as(key_name: str | None, sender: str) -> bool:
    """Whether a message under key ``key_name`` may carry ``sender``: NAME or NAME/INSTANCE.

    Replicas sharing a key each need their own worker id (the server keeps sequence numbers
    per id). No key can claim another key's ids: key names cannot contain the separator.
    """
    if not key_name:
        return False
    prefix = key_name + INSTANCE_SEPARATOR
    return sender == key_name or (sender.startswith(prefix) and len(sender) > len(prefix))


def user_id(frame: zmq.Frame) -> str | None:
    """The ZAP User-Id (key name) a frame was received under; None without ZAP."""
    try:
        return frame.get("User-Id")
    except zmq.ZMQError:
        return None


# ---------------------------------------------------------------- ZAP handler

# A NULL client and a CURVE server each check the other's mechanism; whichever notices first
# reports PROTOCOL (mismatch), the other sees the peer hang up (NO_DETAIL). So both count.
# ZAP denials (HANDSHAKE_FAILED_AUTH) are counted by the handler itself.
_MONITOR_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


class Authenticator:
    """The server's ZAP handler: allow-lists, denial counts, reload on demand.

    Runs one thread owning a REP socket bound to ``inproc://zeromq.zap.01`` of the server's
    context, plus one monitor socket per watched server socket: a NULL or PLAIN client never
    reaches ZAP (its handshake fails on the mechanism), so the monitor is what counts it.
    Accepted keys get their name as the ZAP User-Id, which the server compares with the
    sender of each hello and push. Thread-safe: ``request_reload`` (signal handlers), ``deny`` and
    ``denied`` may be called from any thread.
    """

    def __init__(self, ctx: zmq.Context, keys: ServerKeys, poll_ms: int = 100) -> None:
        self.ctx = ctx
        self.directory = keys.directory
        self.allow = keys.allow  # replaced whole on reload: readers never see a mix
        self.poll_ms = poll_ms
        self.reloads = 0
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reload = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._monitors: list[tuple[str, str]] = []
        self._last_log: dict[str, float] = {}
        self._thread = threading.Thread(target=self._run, name="zap", daemon=True)

    # -- control

    def watch(self, sock: zmq.Socket, label: str) -> None:
        """Count failed handshakes on ``sock`` (call before ``start``)."""
        addr = f"inproc://downpour.monitor.{label}.{id(sock)}"
        sock.monitor(addr, _MONITOR_EVENTS)
        self._monitors.append((label, addr))

    def start(self, timeout_s: float = 5.0) -> None:
        """Start the handler; raise SecurityError if it is not serving within ``timeout_s``."""
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise SecurityError("the ZAP authenticator did not start")
        if self._error is not None:
            raise SecurityError(f"the ZAP authenticator failed to start: {self._error}")
        log.info(
            "CURVE on: %d worker key(s), %d reader key(s) from %s",
            len(self.allow.workers),
            len(self.allow.readers),
            self.directory,
        )

    def request_reload(self) -> None:
        """Re-read the allow-lists soon (safe to call from a signal handler)."""
        self._reload.set()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the thread and close its sockets (before the context is terminated)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def deny(self, reason: str, detail: str = "", log_key: str | None = None) -> None:
        """Count one refusal; log it at most once per ``log_key`` (default reason) per 10 s."""
        key = log_key or reason
        with self._lock:
            self._counts[reason] += 1
            now = time.monotonic()
            quiet = now - self._last_log.get(key, -1e9) >= 10.0
            if quiet:
                self._last_log[key] = now
        if quiet:
            log.warning("authentication denied (%s)%s", reason, f": {detail}" if detail else "")

    def denied(self) -> dict[str, int]:
        """Refusals so far, by reason."""
        with self._lock:
            return dict(self._counts)

    def status(self) -> dict[str, Any]:
        """The status-document fields of authentication."""
        denied = self.denied()
        return {
            "auth": {
                "mechanism": "curve",
                "workers": len(self.allow.workers),
                "readers": len(self.allow.readers),
                "reloads": self.reloads,
            },
            "auth_denied": denied,
            "auth_denied_total": sum(denied.values()),
        }

    # -- the thread

    def _run(self) -> None:
        sockets: list[zmq.Socket] = []
        try:
            zap = self.ctx.socket(zmq.REP)
            sockets.append(zap)
            zap.linger = 0
            zap.bind(ZAP_ENDPOINT)
            poller = zmq.Poller()
            poller.register(zap, zmq.POLLIN)
            monitors: dict[zmq.Socket, str] = {}
            for label, addr in self._monitors:
                m = self.ctx.socket(zmq.PAIR)
                sockets.append(m)
                m.linger = 0
                m.connect(addr)
                monitors[m] = label
                poller.register(m, zmq.POLLIN)
        except zmq.ZMQError as exc:
            self._error = exc
            self._ready.set()
            for s in sockets:
                s.close(0)
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                if self._reload.is_set():
                    self._reload.clear()
                    self._do_reload()
                for sock, _ in poller.poll(self.poll_ms):
                    if sock is zap:
                        self._answer(zap)
                    else:
                        self._monitor_event(sock, monitors[sock])
        finally:
            for s in sockets:
                s.close(0)

    def _do_reload(self) -> None:
        old = self.allow
        try:
            new = load_allow_lists(self.directory)
        except SecurityError as exc:
            log.error("key reload failed, keeping the previous allow-lists: %s", exc)
            return
        self.allow = new
        self.reloads += 1
        gone = sorted(set(old.workers.values()) - set(new.workers.values()))
        added = sorted(set(new.workers.values()) - set(old.workers.values()))
        log.info(
            "reloaded keys: %d worker(s), %d reader(s); added %s, removed %s "
            "(removed keys are refused on new connections)",
            len(new.workers),
            len(new.readers),
            added or "none",
            gone or "none",
        )

    def _answer(self, zap: zmq.Socket) -> None:
        """Answer one ZAP request; always replies, so libzmq never waits on us."""
        frames = zap.recv_multipart()
        request_id = frames[1] if len(frames) > 1 else b""
        try:
            code, text, name = self._judge(frames)
        except Exception:  # a bug here must refuse the client, not kill the handler
            log.exception("ZAP request failed; refusing the client")
            self.deny(D_BAD_REQUEST)
            code, text, name = b"500", D_BAD_REQUEST, ""
        zap.send_multipart([b"1.0", request_id, code, text.encode(), name.encode(), b""])

    def _judge(self, frames: list[bytes]) -> tuple[bytes, str, str]:
        # ZAP (RFC 27): version, request id, domain, address, routing id, mechanism, creds...
        if len(frames) < 6 or frames[0] != b"1.0":
            self.deny(D_BAD_REQUEST, f"{len(frames)} frames")
            return b"500", D_BAD_REQUEST, ""
        _version, _request_id, domain, address, _rid, mechanism = frames[:6]
        dom = domain.decode(errors="replace")
        code, text, name = self._decide(dom, mechanism, frames[6:])
        if code != b"200":
            who = address.decode(errors="replace")
            detail = f"{mechanism.decode(errors='replace')} client from {who} (ZAP domain {dom})"
            self.deny(text, detail, f"{text}:{dom}")
        return code, text, name

    def _decide(
        self, domain: str, mechanism: bytes, creds: Iterable[bytes]
    ) -> tuple[bytes, str, str]:
        """(status code, reason or "OK", user id) for one ZAP request."""
        if mechanism != b"CURVE":
            return b"400", D_MECHANISM, ""
        creds = list(creds)
        if len(creds) != 1 or len(creds[0]) != 32:
            return b"400", D_BAD_REQUEST, ""
        key = z85.encode(creds[0])
        allow = self.allow
        name = allow.workers.get(key)
        if name is not None and domain in (TRAINING_DOMAIN, STATUS_DOMAIN):
            return b"200", "OK", name
        reader = allow.readers.get(key)
        if reader is not None and domain == STATUS_DOMAIN:
            return b"200", "OK", reader
        if reader is not None:
            return b"400", D_NOT_ALLOWED, ""
        return b"400", D_UNKNOWN_KEY, ""

    def _monitor_event(self, sock: zmq.Socket, label: str) -> None:
        from zmq.utils.monitor import parse_monitor_message

        event = parse_monitor_message(sock.recv_multipart())
        value = event["value"]
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            what = "client hung up during the handshake (a non-CURVE client or a probe)"
            self.deny(D_HANDSHAKE, f"{what} on the {label} socket", f"h:{label}")
        elif value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            self.deny(D_MECHANISM, f"non-CURVE client on the {label} socket", f"m:{label}")
        else:
            self.deny(
                D_HANDSHAKE, f"handshake failed on the {label} socket ({value})", f"p:{label}"
            )


def status_fields(auth: Authenticator | None) -> dict[str, Any]:
    """``auth``, ``auth_denied`` and ``auth_denied_total`` for the status document."""
    if auth is None:
        return {"auth": {"mechanism": "null"}, "auth_denied": {}, "auth_denied_total": 0}
    return auth.status()

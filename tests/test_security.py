"""Security: CURVE on every socket, allow-listed keys, identity binding, key hygiene.

Servers on 127.0.0.1 with the tiny model, in-process (fast tier) and as real processes (slow
tier) through the ``services`` fixture; raw sockets play the attackers.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
import zmq.auth
from conftest import ROOT, Cluster, Service, env, summary, wait_until
from inproc import InprocServer, Services, WorkerThread, make_worker, serving
from relay import UP, Relay

from downpour import wire
from downpour.cli.status import fetch_status
from downpour.net import security
from downpour.net.client import ShardClient
from downpour.net.transport import RequestTimeout
from downpour.wire import Message

TINY_NAMES = ["hidden/kernel", "hidden/bias", "logits/kernel", "logits/bias"]
# A distinctive float pattern (not anything a model would compute) to look for on the wire.
PATTERN = np.array([1.125, -2.375, 3.0625, -4.8125, 5.5, -6.15625, 7.75, -8.0], np.float32)


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    """A key directory: server, workers w0 and w1, status reader "status"."""
    d = tmp_path / "keys"
    security.generate_keys(d, ["w0", "w1"], ["status"])
    return d


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    c.setsockopt(zmq.LINGER, 0)
    try:
        yield c
    finally:
        c.destroy(linger=0)


def client_keys(key_dir: Path, name: str, server_dir: Path | None = None) -> security.ClientKeys:
    """The named client's key pair and the server's public key."""
    return security.load_client_keys(
        key_dir / "clients" / f"{name}.key_secret", (server_dir or key_dir) / "server.key"
    )


def key_args(key_dir: Path, name: str) -> list[str]:
    """Worker options for the named key."""
    return [
        "--key",
        str(key_dir / "clients" / f"{name}.key_secret"),
        "--server-key",
        str(key_dir / "server.key"),
    ]


def status(server: Service, key_dir: Path, name: str = "status") -> dict[str, Any]:
    """The status document, read with a reader key over CURVE."""
    return fetch_status(server.status, timeout_s=5, keys=client_keys(key_dir, name))


def pull(
    ctx: zmq.Context, server: Service, keys: security.ClientKeys | None, timeout_s: float = 5
) -> tuple[int, list[np.ndarray]]:
    """(version, copies of the weights) pulled from the REP socket."""
    sender = keys.keypair.name if keys is not None else "test-probe"  # CURVE binds the name
    client = ShardClient(ctx, server.rep, sender=sender, timeout_s=timeout_s, keys=keys)
    try:
        weights = client.pull()
        return weights.version, [np.array(a) for a in weights.tensors.values()]
    finally:
        client.close()


def push_socket(ctx: zmq.Context, endpoint: str, keys: security.ClientKeys | None) -> zmq.Socket:
    """A raw PUSH socket (CURVE when ``keys``), as an attacker or a test would use."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDTIMEO, 5000)
    if keys is not None:
        security.configure_curve_client(sock, keys)
    sock.connect(endpoint)
    return sock


def gradients(sender: str, seq: int, fill: float = 0.01) -> list[Any]:
    """Encoded push frames for the tiny model: every gradient ``fill``, the first the PATTERN."""
    shapes = [(16, 32), (32,), (32, 4), (4,)]
    arrays = [np.full(s, fill, np.float32) for s in shapes]
    arrays[0] = np.resize(PATTERN, shapes[0]).astype(np.float32)
    tensors = dict(zip(TINY_NAMES, arrays, strict=True))
    return wire.encode(Message(wire.PUSH, sender, seq=seq, tensors=tensors))


def refused(fn: Any) -> bool:
    """True if ``fn()`` got no answer (a refused connection looks like silence)."""
    try:
        fn()
    except RequestTimeout:
        return True
    return False


# ---------------------------------------------------------------- in-process units


def test_keygen_writes_zmq_certificates_with_safe_modes(tmp_path: Path) -> None:
    old = os.umask(0)  # even with no umask, a secret is never readable by others
    try:
        created = security.generate_keys(tmp_path / "k", ["a", "b"], ["r"])
    finally:
        os.umask(old)
    d = tmp_path / "k"
    assert len(created) == 2 + 2 * 3
    for path in created:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o600 if path.name.endswith("_secret") else 0o644), (path, oct(mode))
    assert not list(d.rglob("*.tmp"))
    public, secret = zmq.auth.load_certificate(d / "clients" / "a.key_secret")
    assert secret is not None and zmq.curve_public(secret) == public
    assert zmq.auth.load_certificate(d / "workers" / "a.key")[0] == public
    allow = security.load_allow_lists(d)
    assert sorted(allow.workers.values()) == ["a", "b"] and list(allow.readers.values()) == ["r"]

    server_before = (d / "server.key_secret").read_bytes()
    security.generate_keys(d, ["c"])  # adding a worker keeps the server key
    assert (d / "server.key_secret").read_bytes() == server_before
    with pytest.raises(security.SecurityError, match="never overwritten"):
        security.generate_keys(d, ["a"])


def test_keygen_command(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "downpour", "keygen", str(tmp_path / "k"), "--names", "x,y"],
        capture_output=True,
        env=env(),
        cwd=ROOT,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert {Path(p).name for p in out.stdout.decode().split()} == {
        "server.key",
        "server.key_secret",
        "x.key",
        "x.key_secret",
        "y.key",
        "y.key_secret",
        "status.key",
        "status.key_secret",
    }


def test_keys_refused_without_curve_support(keys: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zmq, "has", lambda capability: capability != "curve")
    with pytest.raises(security.SecurityError, match="without CURVE"):
        security.load_server_keys(keys)
    with pytest.raises(security.SecurityError, match="without CURVE"):
        client_keys(keys, "w0")


def test_zap_is_enforced_when_no_handler_runs(keys: Path, ctx: zmq.Context) -> None:
    server_keys = security.load_server_keys(keys)
    pull_sock = ctx.socket(zmq.PULL)
    security.configure_curve_server(pull_sock, server_keys, security.TRAINING_DOMAIN)
    port = pull_sock.bind_to_random_port("tcp://127.0.0.1")
    push = push_socket(ctx, f"tcp://127.0.0.1:{port}", client_keys(keys, "w0"))
    push.send(b"before the handler", zmq.NOBLOCK)
    # a valid key, the right server key, no ZAP handler: libzmq must not let it through
    assert pull_sock.poll(1500) == 0
    auth = security.Authenticator(ctx, server_keys)
    auth.start()
    try:  # the client keeps reconnecting; now the handler admits it under its name
        assert pull_sock.poll(10_000), "the handler never admitted the client"
        frame = pull_sock.recv(copy=False)
        assert frame.bytes == b"before the handler"
        assert security.user_id(frame) == "w0"
    finally:
        auth.stop()


def test_server_refuses_to_start_when_the_authenticator_cannot(
    keys: Path, ctx: zmq.Context
) -> None:
    squatter = ctx.socket(zmq.REP)
    squatter.bind(security.ZAP_ENDPOINT)  # another handler holds the ZAP endpoint
    auth = security.Authenticator(ctx, security.load_server_keys(keys))
    with pytest.raises(security.SecurityError, match="failed to start"):
        auth.start()


# ---------------------------------------------------------------- real processes


@pytest.mark.slow
def test_unknown_key_gets_nothing_while_an_honest_worker_trains(
    cluster: Cluster, keys: Path, tmp_path: Path, ctx: zmq.Context
) -> None:
    stranger_dir = tmp_path / "stranger"  # a well-formed key pair the server never listed
    security.generate_keys(stranger_dir, ["intruder"])
    stranger = client_keys(stranger_dir, "intruder", server_dir=keys)
    server = cluster.server("--keys", str(keys))
    honest = cluster.worker(
        server.info["port"], "--steps", "100000", *key_args(keys, "w0"), worker_id="w0"
    )
    intruder = cluster.worker(
        server.info["port"],
        "--steps",
        "5",
        "--key",
        str(stranger_dir / "clients" / "intruder.key_secret"),
        "--server-key",
        str(keys / "server.key"),
        "--request-timeout",
        "1",
        "--server-timeout",
        "3",
        worker_id="intruder",
    )
    raw = push_socket(ctx, f"tcp://127.0.0.1:{server.info['push_port']}", stranger)
    raw.send_multipart(gradients("intruder", 1, fill=1e3))
    assert intruder.wait(timeout=120) == 3, intruder.log_text()
    assert "did not answer" in intruder.log_text()

    denied = wait_until(
        lambda: (d := status(server, keys))["auth_denied"].get("unknown_key", 0) >= 2 and d,
        30,
        "the intruder's worker and raw push to be denied",
    )
    assert refused(lambda: pull(ctx, server, stranger, timeout_s=1))
    v = denied["version"]
    wait_until(lambda: status(server, keys)["version"] >= v + 20, 120, "w0 to keep training")
    honest.proc.send_signal(signal.SIGTERM)
    assert honest.wait(timeout=60) == 0, honest.log_text()
    pushes = summary(honest)["pushes"]

    doc = wait_until(
        lambda: (d := status(server, keys))["pushes_received"] >= pushes and d, 30, "all pushes"
    )
    assert set(doc["workers"]) == {"w0"}  # the intruder never registered
    assert doc["version"] == doc["workers"]["w0"]["applied"] == pushes  # only w0's pushes
    assert doc["pushes_received"] == pushes and doc["rejected_total"] == 0
    assert doc["auth"]["mechanism"] == "curve"


def test_null_clients_are_refused_on_all_three_sockets(
    services: Services, keys: Path, ctx: zmq.Context
) -> None:
    server = services.server(keys=keys)
    plain = ShardClient(ctx, server.rep, sender="w0", timeout_s=1)
    assert refused(lambda: plain.hello(wire.HelloRequest()))
    plain.close()
    push = push_socket(ctx, f"tcp://127.0.0.1:{server.info['push_port']}", None)
    # the handshake fails and the connection drops; a send made before the reconnect finds no
    # pipe and times out, which is a refusal too (the denial below is logged either way)
    with contextlib.suppress(zmq.Again):
        push.send_multipart(gradients("w0", 1))
    # status cannot be read without a key, nor with a key the server does not know
    assert refused(lambda: fetch_status(server.status, timeout_s=1))
    # each refusal is seen as a mechanism mismatch, or as the client hanging up when it
    # noticed the mismatch first: either way counted and logged for that socket
    wait_until(
        lambda: all(
            f"on the {s} socket" in services.log(server) for s in ("rep", "push", "status")
        ),
        30,
        "a denial logged for each socket",
    )
    doc = status(server, keys)
    denied = doc["auth_denied"]
    assert denied.get("mechanism", 0) + denied.get("handshake", 0) >= 3
    assert set(denied) <= {"mechanism", "handshake"}
    assert doc["version"] == 0 and doc["pushes_received"] == 0 and doc["hellos"] == 0
    assert doc["workers"] == {}


def test_reader_keys_read_status_only(services: Services, keys: Path, ctx: zmq.Context) -> None:
    server = services.server(keys=keys)
    reader = client_keys(keys, "status")
    assert status(server, keys, "status")["version"] == 0
    assert status(server, keys, "w0")["version"] == 0  # a worker may read status too
    assert refused(lambda: pull(ctx, server, reader, timeout_s=1))
    assert pull(ctx, server, client_keys(keys, "w0"))[0] == 0
    doc = status(server, keys)
    assert doc["auth_denied"].get("not_allowed", 0) >= 1


def test_push_under_another_workers_name_is_rejected(
    services: Services, keys: Path, ctx: zmq.Context
) -> None:
    server = services.server(keys=keys)
    w1 = client_keys(keys, "w1")
    version0, before = pull(ctx, server, client_keys(keys, "w0"))
    push = push_socket(ctx, f"tcp://127.0.0.1:{server.info['push_port']}", w1)
    push.send_multipart(gradients("w0", 1, fill=0.5))  # w1's key, w0's name

    doc = wait_until(
        lambda: (d := status(server, keys))["rejected"].get("identity") == 1 and d,
        30,
        "the impersonating push to be rejected",
    )
    assert doc["auth_denied"].get("identity") == 1
    assert "w0" not in doc["workers"]  # the claimed worker was not touched
    version1, after = pull(ctx, server, client_keys(keys, "w0"))
    assert version1 == version0 == 0
    for a, b in zip(before, after, strict=True):
        assert np.array_equal(a, b)

    push.send_multipart(gradients("w1", 1, fill=0.5))  # the same key under its own name
    wait_until(lambda: status(server, keys)["version"] == 1, 30, "w1's own push applied")
    doc = status(server, keys)
    assert set(doc["workers"]) == {"w1"} and doc["rejected"] == {"identity": 1}

    # a worker started with another worker's name is refused at hello
    if services.cluster is not None:
        w = services.cluster.worker(
            server.info["port"], "--steps", "3", *key_args(keys, "w1"), worker_id="w0"
        )
        assert w.wait(timeout=120) == 3
        assert "refused" in w.log_text() and "w1" in w.log_text()
    else:
        from downpour.worker.service import WorkerError

        worker = make_worker(server.port, steps=3, keys=client_keys(keys, "w1"), worker_id="w0")
        try:
            with pytest.raises(WorkerError, match="refused") as err:
                worker.run()
        finally:
            worker.close()
        assert "w1" in str(err.value)


@pytest.mark.slow
def test_non_loopback_bind_without_keys_is_refused(cluster: Cluster) -> None:
    server = cluster.server("--host", "0.0.0.0", wait=False)
    assert server.wait(timeout=120) == 2
    log = server.log_text()
    assert "--insecure" in log and "refusing to bind 0.0.0.0" in log


@pytest.mark.slow
def test_loopback_without_keys_serves_and_warns(cluster: Cluster) -> None:
    server = cluster.server()
    assert "without authentication or encryption" in server.log_text()
    doc = fetch_status(server.status)
    assert doc["auth"] == {"mechanism": "null"} and doc["auth_denied"] == {}


def test_secret_key_readable_by_others_refuses_to_start(cluster: Cluster, keys: Path) -> None:
    (keys / "server.key_secret").chmod(0o644)
    server = cluster.server("--keys", str(keys), wait=False)
    assert server.wait(timeout=120) == 2
    assert "mode 0644" in server.log_text() and "chmod 600" in server.log_text()

    (keys / "clients" / "w0.key_secret").chmod(0o640)
    worker = cluster.worker(1, "--steps", "1", *key_args(keys, "w0"), worker_id="w0")
    assert worker.wait(timeout=120) == 2
    assert "mode 0640" in worker.log_text()


def test_sighup_applies_removed_and_added_keys(
    services: Services, keys: Path, ctx: zmq.Context
) -> None:
    server = services.server(keys=keys)
    w1 = client_keys(keys, "w1")
    assert pull(ctx, server, w1)[0] == 0  # w1 is let in

    (keys / "workers" / "w1.key").unlink()
    security.generate_keys(keys, ["w2"])
    services.reload_keys(server)  # SIGHUP for a process
    wait_until(lambda: status(server, keys)["auth"]["reloads"] == 1, 5, "the reload")
    wait_until(
        lambda: refused(lambda: pull(ctx, server, w1, timeout_s=0.5)),
        5,
        "w1's new connections to be refused",
    )
    assert pull(ctx, server, client_keys(keys, "w2"))[0] == 0  # the added key is let in
    assert pull(ctx, server, client_keys(keys, "w0"))[0] == 0  # the others are untouched
    doc = status(server, keys)
    assert doc["auth_denied"]["unknown_key"] >= 1 and doc["auth"]["workers"] == 2


@pytest.mark.parametrize("secure", [False, True], ids=["plaintext", "curve"])
def test_curve_encrypts_gradients_on_the_wire(
    services: Services, keys: Path, ctx: zmq.Context, secure: bool
) -> None:
    server = services.server(keys=keys if secure else None)
    read = (lambda: status(server, keys)) if secure else (lambda: fetch_status(server.status))
    needle = PATTERN.tobytes()
    with Relay(("127.0.0.1", server.info["push_port"]), record=True) as relay:
        push = push_socket(ctx, relay.endpoint, client_keys(keys, "w0") if secure else None)
        push.send_multipart(gradients("w0", 1))
        wait_until(lambda: read()["version"] == 1, 30, "the relayed push to be applied")
        recorded = relay.recorded(UP)
    assert len(recorded) > 16 * 32 * 4  # the whole gradient list went through the relay
    assert (needle in recorded) is not secure


def test_loopback_without_keys_serves_in_plaintext(services: Services) -> None:
    server = services.server()
    doc = fetch_status(server.status)
    assert doc["auth"] == {"mechanism": "null"} and doc["auth_denied"] == {}


def test_unknown_key_gets_nothing_while_an_honest_worker_trains_in_process(
    keys: Path, tmp_path: Path, ctx: zmq.Context
) -> None:
    """The in-process counterpart of the process test above, for the fast tier."""
    with serving(keys=security.load_server_keys(keys)) as server:
        unknown_key_scenario(server, keys, tmp_path, ctx)


def unknown_key_scenario(
    server: InprocServer, keys: Path, tmp_path: Path, ctx: zmq.Context
) -> None:
    """An intruder's worker and raw push are denied while w0 trains, all in-process."""
    from downpour.worker.service import WorkerError

    stranger_dir = tmp_path / "stranger"  # a well-formed key pair the server never listed
    security.generate_keys(stranger_dir, ["intruder"])
    stranger = client_keys(stranger_dir, "intruder", server_dir=keys)
    honest = WorkerThread(
        make_worker(server.port, steps=100_000, keys=client_keys(keys, "w0"), worker_id="w0")
    )
    try:
        raw = push_socket(ctx, f"tcp://127.0.0.1:{server.info['push_port']}", stranger)
        raw.send_multipart(gradients("intruder", 1, fill=1e3))
        intruder = make_worker(
            server.port,
            steps=5,
            keys=stranger,
            worker_id="intruder",
            request_timeout_s=1.0,
            server_timeout_s=3.0,
        )
        try:
            with pytest.raises(WorkerError, match="did not answer"):
                intruder.run()
        finally:
            intruder.close()
        denied = wait_until(
            lambda: (d := status(server, keys))["auth_denied"].get("unknown_key", 0) >= 2 and d,
            30,
            "the intruder's worker and raw push to be denied",
        )
        assert refused(lambda: pull(ctx, server, stranger, timeout_s=1))
        v = denied["version"]
        wait_until(lambda: status(server, keys)["version"] >= v + 20, 60, "w0 to keep training")
    finally:
        honest.worker.stop()
    pushes = honest.result()["pushes"]
    doc = wait_until(
        lambda: (d := status(server, keys))["pushes_received"] >= pushes and d, 30, "all pushes"
    )
    assert set(doc["workers"]) == {"w0"}  # the intruder never registered
    assert doc["version"] == doc["workers"]["w0"]["applied"] == pushes  # only w0's pushes
    assert doc["pushes_received"] == pushes and doc["rejected_total"] == 0
    assert doc["auth"]["mechanism"] == "curve"

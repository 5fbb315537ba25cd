"""Keys as the deployments hand them over.

- systemd credentials: ``LoadCredential=`` on tmpfs gives the file mode 0400 plus an ACL
  entry for the service's user, which the mode shows as 0440. Accepted only when that ACL lets
  nobody else read the key.
- Replicas sharing one key (compose ``--scale``, a Kubernetes Deployment): key NAME may speak
  as NAME/INSTANCE, each instance with its own sequence numbers; never as another key's name.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest
import zmq
from conftest import wait_until
from inproc import Services

from downpour import wire
from downpour.cli.status import fetch_status
from downpour.net import security
from downpour.wire import Message

ACL_USER_OBJ, ACL_USER, ACL_GROUP_OBJ, ACL_MASK, ACL_OTHER = 0x01, 0x02, 0x04, 0x10, 0x20
NO_ID = 0xFFFFFFFF


def set_acl(path: Path, *entries: tuple[int, int, int]) -> None:
    """Write a POSIX access ACL (the xattr setfacl writes); skip where the fs has none."""
    raw = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)
    try:
        os.setxattr(path, "system.posix_acl_access", raw)
    except OSError as exc:
        pytest.skip(f"no POSIX ACLs on {path.parent}: {exc}")


def credential(tmp_path: Path, *extra: tuple[int, int, int], group: int = 0) -> Path:
    """A secret key file as systemd writes a credential: 0400, then read access by ACL."""
    security.generate_keys(tmp_path / "k", ["w0"])
    path = tmp_path / "k" / "server.key_secret"
    path.chmod(0o400)
    set_acl(
        path,
        (ACL_USER_OBJ, 4, NO_ID),
        *extra,
        (ACL_GROUP_OBJ, group, NO_ID),
        (ACL_MASK, 4, NO_ID),
        (ACL_OTHER, 0, NO_ID),
    )
    return path


def test_a_systemd_credential_readable_only_by_this_user_is_accepted(tmp_path: Path) -> None:
    path = credential(tmp_path, (ACL_USER, 4, os.geteuid()))
    assert path.stat().st_mode & 0o777 == 0o440  # what the mode shows: the ACL mask
    assert security.read_certificate(path, secret=True).secret


def test_an_acl_that_lets_someone_else_read_is_refused(tmp_path: Path) -> None:
    path = credential(tmp_path, (ACL_USER, 4, os.geteuid() + 4242))
    with pytest.raises(security.SecurityError, match="must not be readable"):
        security.read_certificate(path, secret=True)
    path = credential(tmp_path / "g", group=4)  # the owning group may read
    with pytest.raises(security.SecurityError, match="must not be readable"):
        security.read_certificate(path, secret=True)


def test_instance_names_belong_to_their_key_only() -> None:
    assert security.may_speak_as("pool", "pool")
    assert security.may_speak_as("pool", "pool/worker-7f9c")
    assert not security.may_speak_as("pool", "pool/")
    assert not security.may_speak_as("pool", "poolx/a")  # a longer key name is another key
    assert not security.may_speak_as("pool", "w0")
    assert not security.may_speak_as(None, "pool/a")
    with pytest.raises(security.SecurityError):
        security.check_name("pool/a")  # so no key can be named like an instance


def test_replicas_sharing_a_key_train_under_their_own_ids(
    services: Services, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    security.generate_keys(keys, ["pool", "poolx"], ["status"])
    server = services.server(keys=keys)
    pool_key = keys / "clients" / "pool.key_secret"
    (s,) = services.train(server.port, ids=["pool/a"], key=(pool_key, keys / "server.key"), steps=5)
    assert s["steps"] == 5
    if services.cluster is not None:  # the command line's warning for a foreign --id
        assert "neither the key's name" not in services.workers[0].log_text()
    reader = security.load_client_keys(keys / "clients" / "status.key_secret", keys / "server.key")

    def status() -> dict:
        return fetch_status(server.status, timeout_s=5, keys=reader)

    # Another replica with the same key: its own id, its own sequence numbers from 1.
    ctx = zmq.Context()
    try:
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        security.configure_curve_client(
            push, security.load_client_keys(pool_key, keys / "server.key")
        )
        push.connect(f"tcp://127.0.0.1:{server.info['push_port']}")
        shapes = [(16, 32), (32,), (32, 4), (4,)]
        names = ["hidden/kernel", "hidden/bias", "logits/kernel", "logits/bias"]
        tensors = {n: np.zeros(s, np.float32) for n, s in zip(names, shapes, strict=True)}
        for sender in ("pool/b", "poolx/a"):  # the second is another key's instance
            msg = Message(wire.PUSH, sender, seq=1, base_version=5, tensors=tensors)
            push.send_multipart(wire.encode(msg))
        doc = wait_until(
            lambda: (d := status())["version"] == 6 and d["rejected"].get("identity") and d,
            30,
            "pool/b applied and poolx/a rejected",
        )
    finally:
        ctx.destroy(linger=0)
    assert set(doc["workers"]) == {"pool/a", "pool/b"}
    assert doc["workers"]["pool/b"]["applied"] == 1 and doc["rejected"] == {"identity": 1}

"""``downpour status``: ask a server's status socket and print a table or JSON.

Imports no TensorFlow, so it answers in a fraction of a second.
"""

from __future__ import annotations

import json
import time
from typing import Any

from shared import protocol
from shared.protocol import Message
from shared.security import ClientKeys, curve_client
from shared.transport import ReqClient, make_context


def fetch_status(
    endpoint: str, timeout_s: float = 5.0, keys: ClientKeys | None = None
) -> dict[str, Any]:
    """The status document of the server at ``endpoint`` (tcp://host:port).

    With ``keys`` the request goes over CURVE (a server started with --keys answers nothing
    else: a refused key looks like a server that does not answer).
    """
    ctx = make_context()
    client = ReqClient(ctx, endpoint, timeout_s=timeout_s, retries=0, configure=curve_client(keys))
    try:
        reply = client.request(Message(protocol.STATUS, "status-cli"))
        return reply.body
    finally:
        client.close()
        ctx.term()


def normalise_endpoint(target: str) -> str:
    """Accept tcp://host:port, host:port, or a bare port (on 127.0.0.1)."""
    if target.startswith("tcp://"):
        return target
    if target.isdigit():
        return f"tcp://127.0.0.1:{target}"
    return f"tcp://{target}"


def _fmt(v: Any, nd: int = 4) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}g}"
    return str(v)


def render(doc: dict[str, Any]) -> str:
    """A human-readable table of a status document."""
    st = doc.get("staleness", {})
    lines = [
        f"model {doc.get('model')}  fingerprint {str(doc.get('fingerprint'))[:12]}  "
        f"uptime {doc.get('uptime_s', 0):.0f}s",
        f"version {doc.get('version')}  updates applied {doc.get('updates_applied')}  "
        f"updates/s {_fmt(doc.get('updates_per_s'))}  loss {_fmt(doc.get('loss'))}  "
        f"apply {_fmt(doc.get('apply_ms'))} ms",
        f"staleness mean {_fmt(st.get('mean'))} max {_fmt(st.get('max'))} "
        f"over {st.get('count', 0)} updates",
        "staleness histogram: " + " ".join(f"<={b}:{c}" for b, c in st.get("buckets", []) if c),
        f"bytes in {doc.get('bytes_in', 0):,}  out {doc.get('bytes_out', 0):,}  "
        f"pulls {doc.get('pulls', 0)} ({doc.get('pulls_unchanged', 0)} unchanged)",
        "rejected: "
        + (", ".join(f"{k}={v}" for k, v in sorted(doc.get("rejected", {}).items())) or "none"),
        "",
        f"{'worker':<24} {'state':<8} {'steps':>7} {'applied':>8} {'rejected':>8} "
        f"{'staleness':>9} {'loss':>8} {'steps/s':>8} {'last seen':>9}",
    ]
    for wid, w in sorted(doc.get("workers", {}).items()):
        lines.append(
            f"{wid:<24} {w.get('state', '?'):<8} {w.get('steps', 0):>7} {w.get('applied', 0):>8} "
            f"{w.get('rejected', 0):>8} {_fmt(w.get('staleness')):>9} {_fmt(w.get('loss')):>8} "
            f"{_fmt(w.get('reported', {}).get('steps_per_s'), 3):>8} "
            f"{w.get('last_seen_s', 0):>8.1f}s"
        )
    return "\n".join(lines)


def main(
    targets: list[str],
    as_json: bool,
    watch: float | None,
    timeout_s: float,
    keys: ClientKeys | None = None,
) -> int:
    """Print status for each target; with ``watch``, refresh every that many seconds."""
    while True:
        docs = {}
        for t in targets:
            ep = normalise_endpoint(t)
            try:
                docs[ep] = fetch_status(ep, timeout_s, keys)
            except Exception as exc:  # report every endpoint, then fail
                docs[ep] = {"error": str(exc)}
        if as_json:
            print(json.dumps(docs if len(docs) > 1 else next(iter(docs.values())), indent=2))
        else:
            if watch:
                print("\x1b[2J\x1b[H", end="")
            for ep, doc in docs.items():
                print(f"== {ep}")
                print(doc["error"] if "error" in doc else render(doc))
        if not watch:
            return 1 if any("error" in d for d in docs.values()) else 0
        time.sleep(watch)

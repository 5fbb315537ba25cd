"""Every shard of a partitioned model at once: the one place the "for every shard" loops live.

A ``ShardSet`` holds one ``Shard`` per server (its ``ShardClient``, its gradient
``PushSocket``, the incarnation and weight version last seen, the slice last pulled) and
does what a caller needs of all of them: hello every shard (fingerprint and partition
checked by each), pull every shard and join the slices, split a gradient list and push each
shard its slice under one sequence number, and notice a shard's new incarnation (a restart).

A restarted server may listen for gradients on another port (``--push-port 0``), and a PUSH
socket never reports that nobody reads it: it queues up to its high-water mark, then blocks.
The signal is the REQ side: every pull and heartbeat reply carries the server's incarnation,
and any thread that gets one reports it (``Shard.saw``). A shard whose incarnation differs
from the one it said hello to is greeted again before the next push, and also while a push is
blocked at the high-water mark (``rehello_restarted``): the new hello brings the push port (and the
policy, the last accepted seq ...), the gradient socket is reconnected when the port moved,
and the blocked gradient, computed from the old incarnation's weights, is dropped (counted
``dropped``). Gradients still queued for the old port are lost with its socket.

``pull_full`` is the one-call form for callers without a long-lived worker (``run-local``'s
evaluator, tests, benchmarks). Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from downpour import wire
from downpour.config.policy import PolicyDescription, describe_policy
from downpour.model.partition import Partition, make_partition
from downpour.net import security
from downpour.net.client import Hello, ShardClient, Weights
from downpour.net.transport import Counters, PushSocket, ServerUnavailable, make_context, tcp
from downpour.runtime.metrics import Notices

log = logging.getLogger("downpour.net.cluster")


class Incompatible(Exception):
    """A shard's hello says it cannot decode an encoding this client sends.

    Recovery: none by retrying; upgrade the server or send another encoding. The message names
    the server, the missing encodings and what the server decodes; ``missing`` lists them.
    """

    def __init__(self, message: str, missing: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.missing = tuple(missing)


def partition_of(
    variables: Sequence[Any], num_shards: int, dynamic: Collection[str] = ()
) -> Partition:
    """The partition of a model's trainable variables over ``num_shards`` shards;
    ``dynamic``: the paths of its dynamic tables (``downpour.model.build.dynamic_tables``)."""
    from downpour.model.build import fingerprint  # Keras: only callers holding a model pay for it

    return make_partition(
        [v.path for v in variables],
        [tuple(int(d) for d in v.shape) for v in variables],
        [str(v.dtype) for v in variables],
        num_shards,
        fingerprint(variables),
        [v.path in dynamic for v in variables],
    )


@dataclass
class Shard:
    """What a client holds for one server shard, and what its replies' incarnations say
    (a restart: ``note_incarnation``, ``needs_hello``)."""

    index: int
    host: str
    port: int
    push: PushSocket | None = None
    push_port: int | None = None
    incarnation: str | None = None  # of the weights held (noted by the owning thread)
    hello_incarnation: str | None = None  # the incarnation this client said hello to
    seen_incarnation: str | None = None  # the newest one any thread heard in a reply
    version: int = -1  # this shard's weight version held locally; -1 = none yet
    # a hybrid policy's dense updates as of the weights held (None: not under a hybrid, or
    # the shard holds no dense variable); its dense rounds count these, not versions
    dense_version: int | None = None
    holds_dense: bool = True  # its hello's row_tables leave some of its variables dense
    arrays: list[Any] = field(default_factory=list)  # its slice, as last pulled
    last_contact: float = field(default_factory=time.monotonic)
    ends_job: bool = False  # its hello said it ends a job when its workers finish
    # the owning thread's client (set by ShardSet); other threads use ShardSet.new_client
    client: ShardClient = field(init=False)

    @property
    def endpoint(self) -> str:
        """The shard's REP endpoint."""
        return tcp(self.host, self.port)

    def touch(self) -> None:
        """Note that the shard answered just now."""
        self.last_contact = time.monotonic()

    def note_incarnation(self, incarnation: str | None, version: int) -> bool:
        """Record what the shard says its incarnation is (owning thread); True (and a
        warning) when it differs from the one seen before: the server restarted."""
        restarted = self.incarnation is not None and incarnation != self.incarnation
        if restarted:
            log.warning(
                "server %s restarted (now at version %d); continuing", self.endpoint, version
            )
        self.incarnation = incarnation
        self.saw(incarnation)
        return restarted

    def saw(self, incarnation: str | None) -> None:
        """Note the incarnation a reply from the shard carried (any thread may call this)."""
        if incarnation is not None:
            self.seen_incarnation = incarnation

    def needs_hello(self) -> bool:
        """True when the shard answered from another incarnation than the one greeted: the
        server restarted, maybe on another push port."""
        seen, greeted = self.seen_incarnation, self.hello_incarnation
        return greeted is not None and seen is not None and seen != greeted

    def pull_request(self, encoding: str = wire.DENSE) -> wire.PullRequest:
        """A pull of the shard's weights newer than the ones held (all when none are held)."""
        if self.version < 0:
            return wire.PullRequest(encoding=encoding)
        return wire.PullRequest(self.version, self.incarnation, encoding)


class ShardSet:
    """Clients for every shard of one model, in shard order.

    ``server_timeout_s``: how long hello, pull and push wait out a server that does not
    answer before ServerUnavailable. ``counters`` receives ``reconnects``, ``backpressure``
    and ``dropped``; ``stop`` ends every wait early. ``encodings``: what this client's pushes
    use, which every hello (a restarted shard's too) checks the shard decodes (Incompatible);
    ``sends`` names where they come from in that error (``--compress topk:0.01``).
    ``notices``: the sender's slow paths, for its pushes and heartbeats to report.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        endpoints: Sequence[tuple[str, int]],
        partition: Partition,
        *,
        sender: str,
        keys: security.ClientKeys | None = None,
        timeout_s: float = 10.0,
        retries: int = 0,
        server_timeout_s: float = 0.0,
        limits: wire.Limits = wire.DEFAULT_LIMITS,
        max_msg_bytes: int = -1,
        push_hwm: int = 4,
        push_timeout_s: float = 1.0,
        push_endpoint: tuple[str, int] | None = None,
        counters: Counters | None = None,
        stop: threading.Event | None = None,
        encodings: frozenset[str] = frozenset(),
        sends: str = "this client",
        notices: Notices | None = None,
    ) -> None:
        if len(endpoints) != partition.num_shards:
            raise ValueError(f"{len(endpoints)} endpoints for {partition.num_shards} shards")
        if push_endpoint is not None and len(endpoints) > 1:
            raise ValueError("a push endpoint override works with one server, not with shards")
        self.ctx = ctx
        self.partition = partition
        self.sender = sender
        self.keys = keys
        self.timeout_s = timeout_s
        self.retries = retries
        self.server_timeout_s = server_timeout_s
        self.limits = limits
        self.max_msg_bytes = max_msg_bytes
        self.push_hwm = push_hwm
        self.push_timeout_s = push_timeout_s
        self.push_endpoint = push_endpoint
        self.counters: Counters = counters if counters is not None else {}
        self.stop = stop or threading.Event()
        self.wire_names = [[p.wire_name for p in parts] for parts in partition.shards]
        self.n_vars = 1 + max((p.var for parts in partition.shards for p in parts), default=-1)
        self.shards: list[Shard] = []
        for i, (host, port) in enumerate(endpoints):
            shard = Shard(i, host, port)
            shard.client = self.new_client(shard)
            self.shards.append(shard)
        self.pushed_incarnations: list[str | None] = []  # each shard's, at the last push
        self.model = ""  # what hello said, kept to say it again to a restarted shard
        self.encodings = encodings
        self.sends = sends
        self.policy = ""  # the staleness policy the last hello named (``sync:2/4``, ``async``)
        self.resume_seq = 0  # the highest sequence number a hello said the server accepted
        # the sender's slow paths, sent with its pushes and heartbeats (and warned here)
        self.notices = notices if notices is not None else Notices()

    # ------------------------------------------------------------ state

    @property
    def versions(self) -> list[int]:
        """Each shard's weight version held locally (-1: none yet)."""
        return [s.version for s in self.shards]

    @property
    def version(self) -> int:
        """The oldest of the shards' versions."""
        return min(self.versions)

    @property
    def dense_versions(self) -> list[int | None]:
        """Each shard's dense updates as of the weights held (``Shard.dense_version``)."""
        return [s.dense_version for s in self.shards]

    @property
    def policy(self) -> str:
        """The staleness policy the last hello named (``sync:2/4``, ``async``; "" before
        any). Setting it reads it once (``describe_policy``) into ``policy_description``,
        which the properties below ask."""
        return self._policy

    @policy.setter
    def policy(self, text: str) -> None:
        self._policy = text
        try:
            self.policy_description = describe_policy(text)
        except ValueError:  # none yet, or a form this client does not know: nothing to wait on
            self.policy_description = PolicyDescription(text)

    @property
    def hybrid(self) -> bool:
        """The hello's policy is a hybrid (``dense=SPEC,rows=SPEC``)."""
        return self.policy_description.hybrid

    @property
    def dense_policy(self) -> str:
        """The policy the dense variables follow: the hello's, or a hybrid's dense half."""
        if self.policy_description.dense is None:
            return self.policy
        return self.policy_description.dense.text

    @property
    def sync(self) -> bool:
        """The servers aggregate the dense gradients synchronously (hello: policy
        ``sync:K/N``, or a hybrid's ``dense=sync:K/N``): the dense half aggregates."""
        return self.policy_description.dense_policy.caps.aggregates

    @property
    def ssp(self) -> bool:
        """The servers hold pulls of workers too far ahead (hello: policy ``ssp:K``, or a
        hybrid's ``dense=ssp:K``)."""
        return self.policy_description.caps.holds_pulls

    @property
    def extrapolates(self) -> bool:
        """The servers serve whole pulls extrapolated weights (hello: ``lookahead``)."""
        return self.policy_description.caps.extrapolates

    def note_dense_version(self, shard: Shard, reply: wire.PullReply) -> None:
        """Keep the dense version of a served pull (whole weights or ``unchanged``; a reply
        to a row top-up carries no dense weights and must not be given here). Under a
        hybrid's ``dense=sync:K/N``, a shard holding dense variables whose reply has none
        is a server that does not send it: nothing to wait on there (a notice says so)."""
        if reply.wait_ms != 0:
            return
        shard.dense_version = reply.dense_version
        if reply.dense_version is None and shard.holds_dense and self.hybrid and self.sync:
            self.notices.warn(
                log,
                "server %s runs %s but its pull replies carry no dense_version (a server older "
                "than this client): the dense rounds are not waited for there",
                shard.endpoint,
                self.policy,
            )

    def new_client(self, shard: Shard) -> ShardClient:
        """Another client for ``shard`` (one per thread): same options, its own socket."""
        return ShardClient(
            self.ctx,
            shard.endpoint,
            sender=self.sender,
            timeout_s=self.timeout_s,
            retries=self.retries,
            server_timeout_s=self.server_timeout_s,
            keys=self.keys,
            limits=self.limits,
            max_msg_bytes=self.max_msg_bytes,
            counters=self.counters,
            stop=self.stop,
            on_reply=shard.touch,
        )

    def rehello_restarted(self) -> list[Shard]:
        """Say hello again to every shard that restarted since its hello (owning thread
        only); the shards greeted. Refused / ServerUnavailable / Stopped from the client."""
        again = [s for s in self.shards if s.needs_hello()]
        for shard in again:
            old_port = shard.push_port
            self.hello(shard, self.model)
            self.counters["rehellos"] = self.counters.get("rehellos", 0) + 1
            log.warning(
                "server %s restarted: said hello again (gradients to port %s%s)",
                shard.endpoint,
                shard.push_port,
                "" if shard.push_port == old_port else f", was {old_port}",
            )
        return again

    def restarted_since_push(self) -> bool:
        """Some shard has another incarnation than when the last push was sent to it."""
        return any(
            s.incarnation != inc
            for s, inc in zip(self.shards, self.pushed_incarnations, strict=False)
        )

    # ------------------------------------------------------------ hello

    def hello_request(self, shard: Shard, model: str) -> wire.HelloRequest:
        """The hello body for ``shard``: the model and this client's partition of it."""
        return wire.HelloRequest(
            fingerprint=self.partition.fingerprint,
            model=model,
            variables=self.n_vars,
            shard=shard.index,
            num_shards=self.partition.num_shards,
            partition=self.partition.digest,
        )

    def hello(self, shard: Shard, model: str) -> Hello:
        """Say hello to one shard (again, after a restart, too): note its incarnation, its
        policy and where this sender's sequence resumes, check it decodes ``encodings``, and
        (re)connect the gradient socket when the push port is new. Incompatible; Refused /
        ServerUnavailable / Stopped from the client."""
        self.model = model
        hello = shard.client.hello(self.hello_request(shard, model))
        shard.note_incarnation(hello.reply.incarnation, hello.version)
        shard.hello_incarnation = hello.reply.incarnation
        offered = hello.reply.encodings or ()
        missing = sorted(self.encodings - set(offered))
        if missing:
            raise Incompatible(
                f"server {shard.endpoint} cannot decode the {', '.join(missing)} "
                f"encoding{'s' if len(missing) > 1 else ''} that {self.sends} sends (it "
                f"decodes {', '.join(offered)})",
                missing,
            )
        self.policy = hello.reply.policy
        rows = hello.reply.row_tables
        shard.holds_dense = rows is None or not set(self.wire_names[shard.index]) <= set(rows)
        shard.ends_job = hello.reply.job_workers is not None
        self.resume_seq = max(self.resume_seq, hello.reply.last_seq)
        push_port = hello.reply.push_port
        if push_port != shard.push_port:
            if shard.push is not None:
                shard.push.close()
            host, port = self.push_endpoint or (shard.host, push_port)
            shard.push = PushSocket(
                self.ctx,
                tcp(host, port),
                hwm=self.push_hwm,
                timeout_s=self.push_timeout_s,
                configure=security.curve_client(self.keys),
                counters=self.counters,
            )
            shard.push_port = push_port
        log.debug(
            "%s joined server %s (shard %d of %d) at version %d (model %s)",
            self.sender,
            shard.endpoint,
            shard.index,
            self.partition.num_shards,
            hello.version,
            model,
        )
        return hello

    def hello_all(self, model: str) -> list[Hello]:
        """Hello every shard in shard order (see ``hello``)."""
        return [self.hello(s, model) for s in self.shards]

    # ------------------------------------------------------------ pull

    def check_slice(self, shard: Shard, weights: Weights) -> None:
        """ValueError unless ``weights`` (not unchanged) are exactly ``shard``'s slice."""
        want = self.wire_names[shard.index]
        if list(weights.tensors) != want:
            raise ValueError(
                f"weights from server {shard.endpoint} do not match this model's variables on "
                f"shard {shard.index} (got {list(weights.tensors)[:3]}..., expected "
                f"{want[:3]}...): the endpoints are not this model's shards in shard order"
            )

    def pull_all(self, encoding: str = wire.DENSE) -> list[Weights]:
        """Every shard's weights, pulled concurrently (one short-lived client per shard);
        each is checked to be that shard's slice."""

        def pull(shard: Shard) -> Weights:
            client = self.new_client(shard)
            try:
                return client.pull(shard.pull_request(encoding))
            finally:
                client.close()

        with ThreadPoolExecutor(len(self.shards)) as pool:
            replies = list(pool.map(pull, self.shards))
        for shard, w in zip(self.shards, replies, strict=True):
            shard.note_incarnation(w.reply.incarnation, w.version)
            if not w.unchanged:
                self.check_slice(shard, w)
                shard.arrays, shard.version = list(w.tensors.values()), w.version
        return replies

    def row_requests(self, var: int, ids: np.ndarray) -> list[dict[str, np.ndarray]]:
        """Per shard, the row request for rows ``ids`` (global) of variable ``var``: each id
        routed to the shard holding its row range and rebased to that shard's slice
        (``Partition.route_rows``); every piece named, an empty list where no id falls."""
        out: list[dict[str, np.ndarray]] = [{} for _ in self.shards]
        for k, part, local in self.partition.route_rows(var, ids):
            out[k][part.wire_name] = local
        return out

    def pull_rows(self, var: int, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Rows ``ids`` of row-sparse variable ``var`` from the shards holding them, pulled
        concurrently (one short-lived client per shard, rows only): (unique ids in global
        numbering, their rows, each shard's version). The reassembled rows are what one
        unsharded server would send."""
        requests = self.row_requests(var, ids)

        def pull(k: int) -> Weights:
            client = self.new_client(self.shards[k])
            try:
                return client.pull(wire.PullRequest(rows_only=True), rows=requests[k])
            finally:
                client.close()

        with ThreadPoolExecutor(len(self.shards)) as pool:
            replies = list(pool.map(pull, range(len(self.shards))))
        got_ids, got_rows = [], []
        for k, part, _ in self.partition.route_rows(var, np.zeros(0, np.int64)):
            t = replies[k].tensors.get(part.wire_name)
            if not isinstance(t, wire.Sparse):
                raise ValueError(
                    f"server {self.shards[k].endpoint} sent no rows of {part.wire_name}"
                )
            got_ids.append(part.global_rows(np.asarray(t.indices, np.int64)))
            got_rows.append(np.asarray(t.values))
        return np.concatenate(got_ids), np.concatenate(got_rows), [w.version for w in replies]

    def join(self) -> list[Any]:
        """The whole model's weights in variable order from every shard's slice (None for a
        dynamic table: its rows come by id)."""
        if len(self.shards) == 1 and not any(p.dynamic for p in self.partition.shards[0]):
            return self.shards[0].arrays
        return self.partition.join([s.arrays for s in self.shards], self.n_vars)

    # ------------------------------------------------------------ push

    def push(
        self,
        seq: int,
        grads: Sequence[wire.Tensor],
        base_versions: Sequence[int],
        body: wire.PushBody,
        encode: Callable[[int, list[wire.Tensor]], list[wire.WireTensor]] | None = None,
    ) -> list[int] | None:
        """Send every shard its slice of ``grads`` (``encode(shard index, slice)`` first, if
        given) computed from its ``base_versions`` entry, all under ``seq``. Returns the bytes
        sent to each shard (0 for a shard that restarted while the push was blocked: that
        slice is dropped and the shard greeted again), or None when the stop flag dropped the
        push while blocked. ServerUnavailable when a shard takes nothing for
        ``server_timeout_s``; Refused / Stopped from a new hello."""
        self.rehello_restarted()
        per_shard = [list(grads)] if len(self.shards) == 1 else self.partition.split(grads)
        sizes = []
        for shard, tensors in zip(self.shards, per_shard, strict=True):
            assert shard.push is not None, "hello before pushing"
            encoded = encode(shard.index, tensors) if encode is not None else tensors
            msg = wire.push_message(
                self.sender,
                seq,
                base_versions[shard.index],
                body,
                dict(zip(self.wire_names[shard.index], encoded, strict=True)),
            )
            frames = wire.encode(msg)
            try:
                sent = shard.push.send(
                    frames,
                    self.server_timeout_s,
                    self.stop,
                    abandon=shard.needs_hello,
                )
            except ServerUnavailable:
                raise ServerUnavailable(
                    f"could not push gradients: server {shard.endpoint} not taking them"
                ) from None
            if not sent and self.stop.is_set():
                log.info("stopping: dropped one unsent gradient (seq %d)", seq)
                return None
            if not sent:  # restarted while we were blocked: maybe on another push port
                log.info("server %s restarted: dropped gradient seq %d", shard.endpoint, seq)
                self.rehello_restarted()
                sizes.append(0)
                continue
            sizes.append(sum(memoryview(f).nbytes for f in frames))
        self.pushed_incarnations = [s.incarnation for s in self.shards]
        return sizes

    def finished(self, last_seq: int, stats: dict[str, float] | None = None) -> int:
        """Tell every shard that ends a job (its hello said so) that the sender has done its
        work, ``last_seq`` its last push: each hears it on its REP socket, whether or not
        the sender pushed to it lately. How many were told; ServerUnavailable when one does
        not answer for ``server_timeout_s``."""
        told = [s for s in self.shards if s.ends_job]
        for shard in told:
            shard.client.finished(last_seq, stats, self.notices.items())
        return len(told)

    # ------------------------------------------------------------ lifecycle

    def close(self, push_linger_s: float = 0.0) -> None:
        """Close every shard's sockets; queued pushes get ``push_linger_s`` to leave (when
        the context terminates)."""
        for s in self.shards:
            s.client.close()
            if s.push is not None:
                s.push.close(push_linger_s)


@contextlib.contextmanager
def connected(
    endpoints: Sequence[str],
    variables: Sequence[Any],
    keys: security.ClientKeys | None = None,
    timeout_s: float = 30.0,
    sender: str = "probe",
    dynamic: Collection[str] = (),
) -> Iterator[ShardSet]:
    """A ``ShardSet`` of a model's shards for pulls outside training (one retry each);
    ``endpoints`` are the shards' REP endpoints (tcp://host:port) in shard order,
    ``dynamic`` the paths of the model's dynamic tables."""
    part = partition_of(variables, len(endpoints), dynamic)
    ctx = make_context()
    hosts = [_host_port(e) for e in endpoints]
    shards = ShardSet(ctx, hosts, part, sender=sender, keys=keys, timeout_s=timeout_s, retries=1)
    try:
        yield shards
    finally:
        shards.close()
        ctx.term()


def pull_full(
    endpoints: Sequence[str],
    variables: Sequence[Any],
    keys: security.ClientKeys | None = None,
    timeout_s: float = 30.0,
    sender: str = "probe",
) -> tuple[list[int], list[np.ndarray]]:
    """(each shard's version, the whole model's weights in variable order), pulled from every
    shard concurrently. ``endpoints`` are the shards' REP endpoints (tcp://host:port) in
    shard order."""
    with connected(endpoints, variables, keys, timeout_s, sender) as shards:
        replies = shards.pull_all()
        return [w.version for w in replies], [np.array(a) for a in shards.join()]


def _host_port(endpoint: str) -> tuple[str, int]:
    """(host, port) of tcp://host:port (IPv6 hosts in brackets)."""
    rest = endpoint.removeprefix("tcp://")
    host, _, port = rest.rpartition(":")
    return host.strip("[]"), int(port)

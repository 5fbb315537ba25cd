"""Everything a worker does with a step's gradients: accumulate, compress, number, push.

DistBelief's ``n_push``: gradients are pushed every ``n_push`` steps, averaged over the steps
in between, and every push carries, per shard, the weight version it was computed from (the
oldest in the accumulation). With several shards each gets its slice of the list under one
sequence number, encoded by that shard's own compressor (``--compress``), so a top-k
error-feedback residual belongs to one slice. ``bytes_sent`` counts the message bytes sent,
``bytes_raw`` what the same messages would have taken uncompressed.
"""

from __future__ import annotations

import time

from downpour import wire
from downpour.net.cluster import ShardSet
from downpour.net.transport import Stopped
from downpour.worker.compress import Compressor, parse_compression, payload_bytes, raw_bytes
from downpour.worker.errors import translated
from downpour.worker.splits import SplitMark
from downpour.worker.step import Accumulator


class Pusher:
    """One worker's pushes. ``add`` folds in a step's gradients and pushes when the
    accumulation is due."""

    def __init__(
        self, shards: ShardSet, compress: str, n_push: int, stats: dict[str, float]
    ) -> None:
        self.shards = shards
        self.n_push = n_push
        self.stats = stats
        # one per shard: a top-k residual is kept per position in that shard's slice list
        self.compressors: list[Compressor] = [parse_compression(compress) for _ in shards.shards]
        self._seq = 0
        self.acc = Accumulator()
        self.base_versions = [0] * len(shards.shards)  # of the accumulation under way
        self.base_dense: list[int | None] = [None] * len(shards.shards)  # its dense versions
        self.pushed_from: list[int] | None = None  # base versions of the last push
        self.pushed_dense_from: list[int | None] = list(self.base_dense)  # and dense versions

    @property
    def seq(self) -> int:
        """The sequence number of the last push (where a hello said ours resume, before the
        first)."""
        return max(self._seq, self.shards.resume_seq)

    def encodings(self, dynamic: bool) -> frozenset[str]:
        """The wire encodings these pushes use beyond dense and sparse; ``dynamic``: the
        model has dynamic tables, whose rows go in the compressor's keyed encoding."""
        c = self.compressors[0]
        return c.encodings | {c.keyed_encoding} if dynamic else c.encodings

    @property
    def empty(self) -> bool:
        """No gradient is accumulated: the next step begins an accumulation."""
        return self.acc.count == 0

    def add(
        self,
        grads: list[wire.Tensor],
        loss: float,
        steps: int,
        batch_size: int,
        mark: SplitMark | None = None,
    ) -> bool:
        """Fold in one step's gradients (computed from the weights held now); push the mean
        when ``n_push`` are accumulated, or at once at a split's last batch (``mark``: where
        the batch stands in its split, sent with the push). True when a push was sent."""
        if self.acc.count == 0:
            self.base_versions = self.shards.versions
            self.base_dense = self.shards.dense_versions
        self.acc.add(grads)
        if self.acc.count < self.n_push and not (mark and mark.last):
            return False
        self.pushed_from = self.base_versions
        self.pushed_dense_from = self.base_dense
        split = None if mark is None else (mark.epoch, mark.index, mark.done)
        return self.push(self.acc.take(), self.base_versions, loss, steps, batch_size, split)

    def push(
        self,
        grads: list[wire.Tensor],
        base_versions: list[int],
        loss: float,
        steps: int,
        batch_size: int,
        split: tuple[int, int, int] | None = None,
    ) -> bool:
        """Send one gradient message per shard; waits out back-pressure within the server
        timeout. False when a planned stop dropped the gradient."""
        self._seq = self.seq + 1
        body = wire.PushBody(
            loss=loss,
            batch_size=batch_size,
            steps=steps,
            stats=self.stats,
            split=split,
            notices=self.shards.notices.items() or None,
        )
        t0 = time.perf_counter()
        saved = 0  # payload bytes compression saved in this push

        def encode(shard: int, tensors: list[wire.Tensor]) -> list[wire.WireTensor]:
            nonlocal saved
            out = self.compressors[shard].compress(tensors)
            saved += sum(map(raw_bytes, tensors)) - sum(map(payload_bytes, out))
            return out

        try:
            with translated(stopped=False):
                sizes = self.shards.push(self.seq, grads, base_versions, body, encode=encode)
        except Stopped:
            sizes = None
        if sizes is None:  # a planned stop dropped this gradient (and counted it)
            return False
        self.stats["pushes"] += 1
        self.stats["bytes_sent"] += sum(sizes)
        self.stats["bytes_raw"] += sum(sizes) + saved
        self.stats["push_ms"] = 1e3 * (time.perf_counter() - t0)
        return True

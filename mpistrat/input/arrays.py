"""ArrayDataset: batches of in-memory arrays, shuffled with a seed every rank shares.

>>> import numpy as np
>>> [b.tolist() for b in ArrayDataset(np.arange(5), batch_size=2)]
[[0, 1], [2, 3], [4]]
>>> [b.tolist() for b in ArrayDataset(np.arange(5), batch_size=2).shard(2, 1)]
[[1, 3]]
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import numpy as np

from mpistrat.errors import InvalidArgumentError
from mpistrat.input.batches import Batch, Rows, examine
from mpistrat.input.position import Position, check_position
from mpistrat.input.saved_row import Identity, digest

__all__ = ["ArrayDataset"]


def _positive(name: str, value: Any, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise InvalidArgumentError(f"ArrayDataset: {name} must be an int >= {low}; got {value!r}")
    return int(value)


class ArrayDataset:
    """Global (or, after :meth:`shard`, per-pipeline) batches of a nest of arrays.

    Each pass (each ``iter()``) reshuffles when ``shuffle`` is set, from
    ``(seed, pass number)``: every rank that builds it with the same ``seed`` gets
    the same order, so splitting a global batch across replicas, or sharding the
    examples across pipelines, stays a partition of the data. The pass number is
    :attr:`epoch`; :meth:`set_epoch` moves it, and a :class:`~mpistrat.Checkpoint`
    tracking a distributed dataset made from this one saves and restores it.

    Args:
        data: a nest of arrays sharing a leading dimension (the examples).
        batch_size: examples per batch; the last batch may be shorter.
        shuffle: visit the examples in a new random order at every pass.
        seed: the shuffling seed; it must be the same on every rank.
        drop_remainder: leave out a last batch shorter than ``batch_size``.
        num_shards: keep only every ``num_shards``-th example of each pass's order
            (as ``tf.data.Dataset.shard``), then batch.
        shard_index: which of the ``num_shards`` shards to keep: examples
            ``shard_index::num_shards``.
    """

    def __init__(
        self,
        data: Any,
        batch_size: int,
        *,
        shuffle: bool = False,
        seed: int = 0,
        drop_remainder: bool = False,
        num_shards: int = 1,
        shard_index: int = 0,
    ):
        self._data = examine(data, "ArrayDataset")
        self.batch_size = _positive("batch_size", batch_size)
        self.shuffle = bool(shuffle)
        self.seed = _positive("seed", seed, 0)
        self.drop_remainder = bool(drop_remainder)
        self.num_shards = _positive("num_shards", num_shards)
        if not 0 <= shard_index < self.num_shards or isinstance(shard_index, bool):
            raise InvalidArgumentError(
                f"ArrayDataset: shard_index must be in [0, {self.num_shards}); got {shard_index!r}"
            )
        self.shard_index = int(shard_index)
        self._position = Position()

    def shard(self, num_shards: int, index: int) -> ArrayDataset:
        """A copy that keeps every ``num_shards``-th example starting at ``index``.

        With ``distribute_datasets_from_function``, shard by the input context:
        ``dataset.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)``.
        """
        if self.num_shards != 1:
            raise InvalidArgumentError("ArrayDataset.shard: this dataset is already sharded")
        out = copy.copy(self)
        out.num_shards = _positive("num_shards", num_shards)
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not 0 <= index < num_shards:
            raise InvalidArgumentError(
                f"ArrayDataset.shard: index must be in [0, {num_shards}); got {index!r}"
            )
        out.shard_index = int(index)
        out._position = Position()
        return out

    @property
    def epoch(self) -> int:
        """The pass in progress, or the next one to start: the number its shuffle order comes from.

        A pass that ends moves it on by one; a pass left early counts as in progress until
        the next one starts.
        """
        return self._position.epoch

    def set_epoch(self, epoch: int, step: int = 0) -> None:
        """Make the next pass pass ``epoch`` (its shuffle order), starting after its first ``step`` batches.

        Skipping is index arithmetic: no data is read. Without it the passes count
        themselves from 0; a checkpoint tracking the distributed dataset sets this for you.

        >>> ds = ArrayDataset(np.arange(6), batch_size=2, shuffle=True, seed=7)
        >>> ds.set_epoch(3, step=1)
        >>> order = np.random.default_rng([7, 3]).permutation(6)
        >>> [b.tolist() for b in ds] == [order[2:4].tolist(), order[4:].tolist()], ds.epoch
        (True, 4)
        """
        epoch, step = check_position("ArrayDataset.set_epoch", epoch, step, len(self))
        self._position.set(epoch, step, min(step * self.batch_size, self.num_examples))

    @property
    def num_examples(self) -> int:
        """Examples per pass, after sharding."""
        n = self._data.size
        return max(0, -(-(n - self.shard_index) // self.num_shards))

    @property
    def identity(self) -> Identity:
        """Digests of the order a pass visits the examples in and of their number (a checkpoint
        saves them with the position, and a restore into another dataset is refused)."""
        if self.shuffle:
            order = digest("shuffled", self.seed, self.num_shards, self.shard_index)
        else:
            order = digest("in order", self.num_shards, self.shard_index)
        return Identity(order=order, length=digest(self.num_examples))

    def __len__(self) -> int:
        full, rest = divmod(self.num_examples, self.batch_size)
        return full + (rest > 0 and not self.drop_remainder)

    def _order(self, n: int, epoch: int) -> np.ndarray | None:
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(n)
        elif self.num_shards == 1:
            return None
        else:
            order = np.arange(n)
        return order[self.shard_index :: self.num_shards]

    def __iter__(self) -> Iterator[Any]:
        """One pass (pass :attr:`epoch`): each global batch as a nest of arrays."""
        return (batch.value for batch in self.batches())

    def batches(self) -> Iterator[Batch]:
        """One pass as checked global batches whose shuffled or sharded rows are gathered only when sliced.

        Unshuffled, unsharded leaves are views; otherwise they are :class:`Rows`, so
        ``experimental_distribute_dataset``, which reads an ArrayDataset this way,
        copies only each replica's own rows of every global batch.

        >>> batch = next(ArrayDataset(np.arange(10) * 10, batch_size=4, shuffle=True).batches())
        >>> batch.size, batch.leaves[0], batch.leaves[0][:2].shape
        (4, Rows((4,), int64), (2,))
        """
        serial = self._position.open()  # the order is fixed now, not at the first next()
        return self._counted(self._opened_pass(), serial)

    def _counted(self, batches: Iterator[Batch], serial: int) -> Iterator[Batch]:
        for batch in batches:
            self._position.take(serial, batch.size)
            yield batch
        self._position.end(serial)

    def _opened_pass(self) -> Iterator[Batch]:
        """The pass just opened, from where its position says (uncounted: the caller counts)."""
        position = self._position
        first = position.examples
        if not position.by_examples or first is None:  # after ``step`` batches
            first = min(position.step * self.batch_size, self.num_examples)
        position.skipped(-(-first // self.batch_size), first)
        return self._batches(self._order(self._data.size, position.epoch), first)

    def _batches(self, order: np.ndarray | None, first: int) -> Iterator[Batch]:
        """Batches of the pass in ``order`` from its example ``first`` on (any example: a pass resumed
        after a save made with another batch size starts where the save stood)."""
        leaves, treespec = self._data.leaves, self._data.treespec
        end = self.num_examples
        for lo in range(first, end, self.batch_size):
            hi = min(lo + self.batch_size, end)
            if hi - lo < self.batch_size and self.drop_remainder:
                return
            if order is None:
                yield Batch([a[lo:hi] for a in leaves], treespec, hi - lo)
            else:
                yield Batch([Rows(a, order[lo:hi]) for a in leaves], treespec, hi - lo)

    def __repr__(self) -> str:
        return (
            f"ArrayDataset({self._data.size} examples, batch_size={self.batch_size}, shuffle={self.shuffle}, "
            f"seed={self.seed}, "
            f"shard {self.shard_index} of {self.num_shards})"
        )

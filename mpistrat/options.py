"""Options for collectives and for checkpoints, as tf's ``CommunicationOptions`` and ``CheckpointOptions``."""

from __future__ import annotations

import dataclasses
import enum

from mpistrat.errors import InvalidArgumentError

__all__ = ["COMPRESSIONS", "CheckpointOptions", "CommunicationImplementation", "CommunicationOptions"]

# What ``CommunicationOptions.compression`` accepts: None inherits, "none" turns it off.
COMPRESSIONS = ("none", "bf16", "fp16")


class CommunicationImplementation(enum.Enum):
    """Which transport carries collectives.

    ``AUTO`` picks the best available, ``RING`` is MPI, ``NCCL`` is NCCL (device buffers).
    ``HIERARCHICAL`` sums host (NumPy) buffers node-aware: within each node, between one leader
    per node, then back within the node, so only the leaders send between nodes; with
    ``compression`` only that leg carries 16-bit values (device buffers go as with ``RING``).
    """

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"
    HIERARCHICAL = "HIERARCHICAL"


@dataclasses.dataclass(frozen=True)
class CommunicationOptions:
    """How collectives are carried out.

    >>> opts = CommunicationOptions(bytes_per_pack=4 << 20)
    >>> opts.merge(CommunicationOptions(timeout_seconds=30.0)).bytes_per_pack
    4194304

    Args:
        bytes_per_pack: split the leaves of one dtype into packs of about this many
            bytes, one MPI call each; 0 means one pack per dtype.
        timeout_seconds: give up on a collective that takes longer (None: wait forever).
        implementation: the transport, see :class:`CommunicationImplementation`.
        check: verify that every rank entered the same collective with compatible
            arguments (None: the ``MPISTRAT_CHECK`` environment default, on);
            ``"step"`` checks the first step call by call and every later
            ``strategy.run`` once, at its end (see docs/reliability.md); ``"strict"`` also
            compares the copies of the variables that every-rank merge functions (the
            optimizers) update, by checksum.
        deterministic: floating-point SUM and MEAN return the exact sum of the
            contributions rounded once: the same bits for any ``bytes_per_pack``, leaf
            split, rank order, rank count and MPI algorithm (costs about 2.5x the bytes;
            see docs/concepts.md). None: the strategy's setting (off by default).
        compression: ``"bf16"`` or ``"fp16"``: float32/float64 SUM and MEAN travel as
            16-bit values and are summed in float32 (about half the bytes, each value
            rounded to 16 bits at most twice); ``"none"``: off; None: the strategy's
            setting (off by default). Cannot be combined with ``deterministic=True``.

    >>> CommunicationOptions(deterministic=True).merge(CommunicationOptions(compression="bf16")).reduction
    'bf16'
    """

    bytes_per_pack: int = 0
    timeout_seconds: float | None = None
    implementation: CommunicationImplementation = CommunicationImplementation.AUTO
    check: bool | str | None = None
    deterministic: bool | None = None
    compression: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.bytes_per_pack, int) or self.bytes_per_pack < 0:
            raise InvalidArgumentError(f"bytes_per_pack must be an int >= 0; got {self.bytes_per_pack!r}")
        timeout = self.timeout_seconds
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0
        ):
            raise InvalidArgumentError(
                f"timeout_seconds must be a number of seconds > 0, or None; got {timeout!r}"
            )
        if self.check not in (None, True, False, "step", "strict"):
            raise InvalidArgumentError(
                f"check must be True, False, 'step', 'strict' or None; got {self.check!r}"
            )
        if isinstance(self.implementation, str):
            object.__setattr__(
                self, "implementation", CommunicationImplementation(self.implementation.upper())
            )
        if not isinstance(self.implementation, CommunicationImplementation):
            raise InvalidArgumentError(
                f"implementation must be a CommunicationImplementation; got {self.implementation!r}"
            )
        if not isinstance(self.deterministic, (bool, type(None))):
            raise InvalidArgumentError(
                f"deterministic must be True, False or None; got {self.deterministic!r}"
            )
        compression = self.compression
        if isinstance(compression, str) and compression.lower() in COMPRESSIONS:
            object.__setattr__(self, "compression", compression.lower())
        elif compression is not None:
            raise InvalidArgumentError(
                f"compression must be one of {', '.join(map(repr, COMPRESSIONS))} or None; "
                f"got {compression!r}"
            )
        if self.deterministic and self.compression not in (None, "none"):
            raise InvalidArgumentError(
                f"deterministic=True and compression={self.compression!r} cannot be combined: compressed "
                "sums are rounded to 16 bits, exact ones are not; choose one"
            )

    @property
    def reduction(self) -> str:
        """How float sums travel: ``""`` (plain MPI), ``"deterministic"``, ``"bf16"`` or ``"fp16"``."""
        if self.deterministic:
            return "deterministic"
        if self.compression in ("bf16", "fp16"):
            return self.compression
        return ""

    def merge(self, override: CommunicationOptions | None) -> CommunicationOptions:
        """These options with the non-default fields of ``override`` taking precedence."""
        if override is None:
            return self
        if not isinstance(override, CommunicationOptions):
            raise InvalidArgumentError(
                f"options must be a CommunicationOptions or None; got {type(override).__name__}"
            )
        default = CommunicationOptions()
        changes = {
            f.name: getattr(override, f.name)
            for f in dataclasses.fields(self)
            if getattr(override, f.name) != getattr(default, f.name)
        }
        # deterministic and compression exclude each other: the call's choice replaces the strategy's
        if override.deterministic and "compression" not in changes:
            changes["compression"] = None
        if override.compression not in (None, "none") and "deterministic" not in changes:
            changes["deterministic"] = None
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """How a checkpoint is written and read, as ``tf.train.CheckpointOptions``.

    >>> CheckpointOptions(enable_async=True, io_hints={"striping_factor": 16}).io_hints
    {'striping_factor': '16'}

    Args:
        enable_async: ``save``/``write`` return once this rank's share is copied aside; the
            file is written while training goes on, and the next checkpoint call (a save, a
            restore, ``Checkpoint.sync()``) or the end of the job finishes it: a failure is
            raised on every rank there. (tf's older name, ``experimental_enable_async_checkpoint``,
            is accepted too.)
        io_hints: MPI-IO hints for the file (``MPI_Info`` keys and values), e.g. Lustre's
            ``striping_factor``/``striping_unit`` or ROMIO's ``romio_cb_write``; they add to
            (and override) the ``MPISTRAT_IO_HINTS`` setting. Hints an MPI does not know are ignored.
    """

    enable_async: bool = False
    io_hints: dict[str, str] | None = None
    experimental_enable_async_checkpoint: bool = False

    def __post_init__(self) -> None:
        for name in ("enable_async", "experimental_enable_async_checkpoint"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError(f"{name} must be True or False; got {getattr(self, name)!r}")
        if self.experimental_enable_async_checkpoint:
            object.__setattr__(self, "enable_async", True)
        hints = self.io_hints
        if hints is not None:
            if not isinstance(hints, dict) or not all(isinstance(k, str) and k for k in hints):
                raise InvalidArgumentError(
                    f"io_hints must be a dict of MPI-IO hint names to values; got {hints!r}"
                )
            object.__setattr__(self, "io_hints", {k: str(v) for k, v in hints.items()})

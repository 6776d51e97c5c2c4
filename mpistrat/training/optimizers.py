"""Optimizers that update distributed variables the tf.distribute way, in one fused step.

``apply_gradients`` runs in replica context (``strategy.run``) with this replica's gradients.
SGD and Adam keep their variables and slots in flat per-dtype buffers (``optimizer_state``):
a step is one handshake, one in-place all-reduce of the packed gradients per pack, and the
update in a few vectorised passes. ``shard_state=True``: each rank holds the slots of its 1/R
of the parameters (ZeRO stage 1). ``gradient_accumulation_steps=K`` (Keras 3's): one update
per K calls (``accumulation``). Scale each replica's loss by the *global* batch size.

>>> import mpistrat, numpy as np
>>> w = mpistrat.Variable(np.array([1.0, 2.0]))
>>> opt = mpistrat.optimizers.SGD(learning_rate=0.5)
>>> _ = opt.apply_gradients([(np.array([1.0, 1.0]), w)])
>>> w.numpy(), int(opt.iterations.numpy())
(array([0.5, 1.5]), 1)
>>> adam = mpistrat.optimizers.Adam(0.1, shard_state=True)
>>> _ = adam.apply_gradients([(np.array([1.0, -1.0]), w)])
>>> w.numpy().round(3), adam.get_slot(w, "m").numpy()
(array([0.4, 1.6]), array([ 0.1, -0.1]))
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from mpistrat import context
from mpistrat.collectives.fingerprint import code_of
from mpistrat.comm import packing
from mpistrat.errors import ContextError, InvalidArgumentError
from mpistrat.options import CommunicationOptions
from mpistrat.reduce_op import ReduceOp
from mpistrat.training import overlap
from mpistrat.training.accumulation import Accumulator, checked_steps, exact_rows
from mpistrat.training.optimizer_checks import SAME_BUILD, compare_copies, not_floating, own_replica_strategy
from mpistrat.training.optimizer_state import FlatState, creation_order, own_copy
from mpistrat.training.sharded_slot import ShardedSlot
from mpistrat.training.variables import Variable, VariableAggregation, Writable, plain_variable
from mpistrat.values import local_copy

__all__ = ["Optimizer", "SGD", "Adam", "ShardedSlot"]


class Optimizer:
    """Base class: slot bookkeeping, the step counter and the distributed apply.

    Subclasses name their slots in ``slot_names`` and implement one of:
    ``_update_flat(w, g, slots, lr, step)``, an in-place update of matching 1-D blocks (flat
    storage, one fused step, ``shard_state`` possible); or ``_apply_dense(var, grad, lr, step,
    *slots)``, which writes one variable and its slots (this rank's copies) given the summed
    gradient (``merge_call``, ``batch_reduce_to``, ``update`` per variable).
    """

    slot_names: tuple[str, ...] = ()

    def __init__(
        self,
        learning_rate: float | Callable[[int], float],
        name: str,
        *,
        shard_state: bool = False,
        communication_options: CommunicationOptions | None = None,
        gradient_accumulation_steps: int | None = None,
    ):
        steps = checked_steps(gradient_accumulation_steps, name)
        self._accumulator = None if steps is None or steps == 1 else Accumulator(steps, name)
        if communication_options is not None and not isinstance(communication_options, CommunicationOptions):
            raise InvalidArgumentError(
                f"{name}: communication_options must be a CommunicationOptions or None; got "
                f"{type(communication_options).__name__}"
            )
        # How the gradients are summed (deterministic, compression, ...) over the strategy's options.
        self._communication_options = communication_options
        self._name = name
        # a schedule (a callable of the step) or a plain float64 variable: set in place, checkpointed
        self._learning_rate: Variable | Callable[[int], float]
        if callable(learning_rate):
            self._learning_rate = learning_rate
        else:
            rate = np.array(_checked_rate(learning_rate, name), np.float64)
            self._learning_rate = plain_variable(rate, f"{name}/learning_rate")
        self._strategy = context.get_strategy() if context.has_strategy() else None
        self._iterations: Variable | None = None
        self._slots: dict[int, tuple[Variable, dict[str, Any]]] = {}  # slots: Variable or ShardedSlot
        # flat when the class updates blocks and no subclass took over one variable at a time
        flat = type(self)._update_flat is not Optimizer._update_flat
        flat = flat and type(self)._apply_dense is Optimizer._apply_dense
        if shard_state and not flat:
            raise InvalidArgumentError(
                f"{name}: shard_state=True needs an optimizer with a flat update (_update_flat), as SGD and "
                f"Adam have; {type(self).__name__} updates one variable at a time (_apply_dense)"
            )
        self._shard_state = bool(shard_state)
        self._state: FlatState | None = None  # set by _flat_state() once the slots are known
        self._flat = flat

    def __deepcopy__(self, memo: dict[int, Any]) -> Optimizer:
        """A new optimizer with these settings (the strategy shared), while this one holds no state."""
        if self._iterations is not None or self._slots or self._state is not None:
            raise TypeError(
                f"{self._name}: an optimizer that holds state (its step counter or slots, made by "
                "apply_gradients or build) cannot be deep-copied: its slots live in flat buffers keyed by "
                "the variables it updates. Make a new optimizer with the same arguments, or keep this one's "
                "state with a Checkpoint"
            )
        duplicate = object.__new__(type(self))
        memo[id(self)] = duplicate
        for key, value in self.__dict__.items():
            setattr(duplicate, key, copy.deepcopy(value, memo))
        return duplicate

    @property
    def shard_state(self) -> bool:
        """Whether each rank holds only its 1/R part of the slots (ZeRO stage 1)."""
        return self._shard_state

    def state_nbytes(self) -> int:
        """Bytes of optimizer state this rank holds besides the variables: slots and step buffers."""
        if self._state is not None:
            return self._state.nbytes()
        return sum(int(local_copy(s).nbytes) for _, slots in self._slots.values() for s in slots.values())

    @property
    def gradient_accumulation_steps(self) -> int | None:
        """K: each K calls of ``apply_gradients`` make one update (None: every call does)."""
        return None if self._accumulator is None else self._accumulator.steps

    @property
    def name(self) -> str:
        return self._name

    @property
    def iterations(self) -> Variable:
        """Steps applied so far (an int64 variable; created on first use, collectively)."""
        if self._iterations is None:
            with self._creation_scope():
                extended = context.get_strategy().replicas
                with extended.colocate_vars_with(extended.non_slot_devices([])):
                    self._iterations = Variable(
                        np.int64(0),
                        trainable=False,
                        name=f"{self._name}/iter",
                        aggregation=VariableAggregation.ONLY_FIRST_REPLICA,
                    )
        return self._iterations

    @property
    def learning_rate(self) -> Variable | float:
        """The learning rate, as Keras 3 has it: a number's variable (float64), or a schedule's value
        at the current ``iterations``.

        Settable between steps: a number (written into the variable; the next step uses it) or a
        schedule (a callable of the step, replacing the rate). A rate made from a schedule takes
        only another schedule, as in Keras. Every rank must set the same rate: the step's handshake
        compares them (see :meth:`apply_gradients`).

        >>> opt = SGD(0.1)
        >>> opt.learning_rate = 0.01
        >>> float(opt.learning_rate)
        0.01
        """
        if isinstance(self._learning_rate, Variable):
            return self._learning_rate
        return self._learning_rate(self._step_now())

    @learning_rate.setter
    def learning_rate(self, value: float | Callable[[int], float]) -> None:
        if callable(value):
            self._learning_rate = value
            return
        rate = self._learning_rate
        if not isinstance(rate, Variable):
            raise InvalidArgumentError(
                f"{self._name}: this optimizer was made with a schedule as its learning_rate, so its "
                f"rate is not settable to a number (got {value!r}); set another schedule, or make the "
                "optimizer with a number to set it by hand"
            )
        with Writable(rate) as held:
            held[...] = _checked_rate(value, self._name)

    def _rate_at(self, step: int) -> tuple[float, InvalidArgumentError | None]:
        """The rate the step ``step`` applies, and the error that stops it (not a finite number)."""
        rate = self._learning_rate
        value = float(rate.local_array) if isinstance(rate, Variable) else rate(step)
        try:
            return _checked_rate(value, self._name, f"at step {step}"), None
        except InvalidArgumentError as exc:
            return math.nan, exc

    def _step_now(self) -> int:
        """``iterations`` on this rank, without creating it (0 before the first step)."""
        return 0 if self._iterations is None else int(own_copy(self._iterations).local_array)

    def get_slot(self, var: Variable, slot_name: str) -> Variable | ShardedSlot:
        """The slot variable ``slot_name`` of ``var``."""
        entry = self._slots.get(id(var))
        if entry is None or slot_name not in entry[1]:
            raise InvalidArgumentError(
                f"{self._name}: no slot {slot_name!r} for variable {var.name!r}; slots exist after the first "
                f"apply_gradients or build([var]); this optimizer's slots are {list(self.slot_names)}"
            )
        return entry[1][slot_name]

    def slots_by_variable(self) -> list[tuple[Variable, dict[str, Variable | ShardedSlot]]]:
        """Each variable that has slots, with its slots by name (what a checkpoint saves)."""
        return list(self._slots.values())

    def variables(self) -> list[Variable | ShardedSlot]:
        """The step counter, the learning rate's variable (a number's) and every slot variable."""
        out: list[Variable | ShardedSlot] = [self.iterations]
        if isinstance(self._learning_rate, Variable):
            out.append(self._learning_rate)
        for _, slots in self._slots.values():
            out.extend(slots[n] for n in self.slot_names)
        return out

    def build(self, var_list: list[Variable]) -> None:
        """Create the step counter and the slots of ``var_list`` (collective: every rank calls it)."""
        for var in var_list:
            self._adopt(var)
        self.iterations  # noqa: B018 (creates it)
        new = list({id(v): v for v in var_list if id(v) not in self._slots}.values())
        if not new:
            return
        state = self._flat_state()
        if state is None:
            self._slot_variables(new)
            return
        new.sort(key=creation_order)  # the same order on every rank, whatever order each was given
        if self._strategy is None:  # plain variables: the default strategy's, or the one in scope
            strategy, distributed = context.get_strategy(), context.has_strategy()
        else:
            strategy, distributed = self._strategy, True
        extended = strategy.replicas
        bytes_per_pack = 0
        if distributed:
            collectives = extended.collectives
            bytes_per_pack = collectives.options.bytes_per_pack
            route = collectives.options.merge(self._communication_options).implementation
            described = [
                ("shard_state", str(self._shard_state), None),
                ("bytes_per_pack", str(bytes_per_pack), None),
                ("CommunicationOptions.implementation", route.value, None),
            ] + [(repr(v.name), f"variable #{creation_order(v)} {v.dtype}", v.shape) for v in new]
            collectives.agree(
                f"{self._name}.build",
                fingerprint=code_of(*described),
                describe=lambda: {"leaves": described, "advice": SAME_BUILD},
                error=not_floating(self._name, new),
            )
        elif (error := not_floating(self._name, new)) is not None:
            raise error
        slots = None if self._shard_state else self._slot_variables(new)
        state.add(new, slots, ranks=extended.size, rank=extended.rank, bytes_per_pack=bytes_per_pack)
        if self._shard_state:
            for var in new:
                group, j = state.where[id(var)]
                slot = functools.partial(ShardedSlot, group, j, collectives=extended.collectives)
                self._slots[id(var)] = (var, {n: slot(n, f"{var.name}/{n}") for n in self.slot_names})

    def _slot_variables(self, var_list: list[Variable]) -> dict[str, list[Variable]]:
        """Create each variable's slot variables (zeros, colocated with it); record and return them."""
        out: dict[str, list[Variable]] = {n: [] for n in self.slot_names}
        for var in var_list:
            with self._creation_scope():
                extended = context.get_strategy().replicas
                with extended.colocate_vars_with(var):
                    xp = packing.array_module(local_copy(var))
                    slots = {
                        n: Variable(
                            xp.zeros(var.shape, dtype=var.dtype), trainable=False, name=f"{var.name}/{n}"
                        )
                        for n in self.slot_names
                    }
            self._slots[id(var)] = (var, slots)
            for n, slot in slots.items():
                out[n].append(slot)
        return out

    def _adopt(self, var: Variable) -> None:
        """The optimizer's strategy is its variables' (or the one in scope when it was made)."""
        owner = var.distribute_strategy
        if self._strategy is None and self._iterations is None:
            self._strategy = owner
        if owner is self._strategy:
            return
        if owner is None:
            fix = "create it inside `with strategy.scope():`"
        elif self._strategy is None:
            fix = "create the optimizer, and its other variables, inside `with strategy.scope():`"
        else:
            fix = "use one optimizer per strategy"
        where = "was created outside any strategy's scope" if owner is None else f"belongs to {owner}"
        mine = "outside any scope" if self._strategy is None else f"in {self._strategy}"
        raise InvalidArgumentError(
            f"{self._name}: variable {var.name!r} {where}, but this optimizer updates variables {mine}; {fix}"
        )

    @contextlib.contextmanager
    def _creation_scope(self) -> Iterator[None]:
        """Enter the variables' strategy from the default context; refuse inside merge_fn."""
        mode = context.current_mode()
        if mode.kind is context.MERGE:
            raise ContextError(
                f"{self._name}: cannot create slot variables inside merge_fn (rank 0 alone); call "
                "optimizer.build(var_list) in strategy.scope() first"
            )
        if self._strategy is not None and mode.kind is context.DEFAULT:
            with self._strategy.scope():
                yield
        else:
            yield

    def apply_gradients(self, grads_and_vars: Any) -> Variable:
        """Apply one step from ``(gradient, variable)`` pairs, in replica context.

        Gradients are summed across replicas; pairs whose gradient is None are skipped. Returns
        ``iterations``. A generator of pairs overlaps the sums with itself (``training/overlap.py``).
        ``gradient_accumulation_steps=K``: K-1 of K calls keep the gradients; the K-th applies their mean.
        """
        replica = context.get_replica_context()
        if replica is None:
            raise ContextError(
                f"{self._name}.apply_gradients() cannot be called in cross-replica context; use "
                "strategy.run(fn) to enter replica context"
            )
        if isinstance(grads_and_vars, types.GeneratorType):  # computed as they come: their sums overlap
            accumulating, options = self._accumulator is not None, self._communication_options
            streamed = overlap.Optimizer(
                self._name, self._strategy, self._state, options, accumulating,
                self._adopt, self._update_flat, self.iterations, self._rate_at,
            )  # fmt: skip
            if (grads_and_vars := overlap.apply(streamed, grads_and_vars)) is None:
                return self.iterations
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]
        if not pairs:
            raise InvalidArgumentError(
                f"{self._name}.apply_gradients: no gradients provided for any variable"
            )
        variables = [v for _, v in pairs]
        state = self._flat_state()
        plan = None if state is None else state.cached_plan(variables)
        if plan is None:  # else these variables were checked and built already
            for v in variables:
                if not isinstance(v, Variable):
                    raise InvalidArgumentError(
                        f"{self._name}.apply_gradients: expected (gradient, Variable) pairs; "
                        f"got a {type(v).__name__}"
                    )
                self._adopt(v)
        strategy = own_replica_strategy(self._name, self._strategy, variables)
        if plan is None:
            self.build(variables)
        pending, rows = None, 0
        if (acc := self._accumulator) is not None:
            if not acc.buffers:  # a cycle's first call: the kind of buffers
                acc.rows = self._flat and exact_rows(self._strategy, self._communication_options)
            kept = acc.add([g for g, _ in pairs], variables)
            if kept is None:
                return self.iterations
            pairs, rows = list(zip(kept, variables, strict=True)), (acc.steps if acc.rows else 0)
            pending = acc.take_pending()
            if pending is not None and (state is None or strategy is None):
                acc.drop()
                raise pending
        with contextlib.nullcontext() if acc is None else acc.applying(strategy):
            if state is None:  # one variable at a time, without merge_call (Keras's path)
                self._apply_each(replica, pairs)
                return self.iterations
            counter = own_copy(self.iterations)
            step = int(counter.local_array)
            lr, bad_rate = self._rate_at(step)
            state.step(
                None if strategy is None else strategy.replicas.collectives,
                [g for g, _ in pairs],
                variables,
                self._update_flat,
                lr,
                step,
                plan=plan,
                options=self._communication_options,
                pending=pending or bad_rate,
                rows=rows,
            )
        with Writable(counter) as count:  # this rank's copy: every rank counts the same steps
            count += 1
        return self.iterations

    def accumulation_state(self) -> tuple[Variable, list[tuple[Variable, Any]]] | None:
        """Mid-cycle: what a checkpoint saves of it (:meth:`Accumulator.state`); else None."""
        extended = (self._strategy or context.get_strategy()).replicas
        return None if self._accumulator is None else self._accumulator.state(extended.rank, extended.size)

    def prepare_accumulation(self, var_list: list[Variable] | None) -> None:
        """Buffers for a checkpoint to restore a cycle into (:meth:`Accumulator.restore_into`)."""
        if (acc := self._accumulator) is not None:
            acc.restore_into(var_list, self._flat and exact_rows(self._strategy, self._communication_options))

    def _flat_state(self) -> FlatState | None:
        """The flat state of an optimizer with a flat update (None for a per-variable one)."""
        if self._state is None and self._flat:
            self._state = FlatState(self.slot_names, self._shard_state)
        return self._state

    def _apply_each(self, replica: Any, pairs: list[tuple[Any, Variable]]) -> None:
        """In replica context, as Keras does without merge_call: one fused all-reduce of the gradients
        (``ReplicaContext.all_reduce``), then each variable's ``_apply_dense`` on this rank's copies
        (``extended.update`` in replica context). The update fails on every rank or none."""
        summed = replica.all_reduce(ReduceOp.SUM, [g for g, _ in pairs], self._communication_options)
        counter = own_copy(self.iterations)
        step = int(counter.local_array)
        lr, bad_rate = self._rate_at(step)
        if bad_rate is not None:  # a schedule's value: every rank computes the same
            raise bad_rate
        extended = replica.strategy.replicas
        for grad, (_, var) in zip(summed, pairs, strict=True):
            slots = self._slots[id(var)][1]
            extended.update(
                var, self._apply_dense, args=(grad, lr, step, *(slots[n] for n in self.slot_names))
            )
        with Writable(counter) as count:  # this rank's copy: every rank counts the same steps
            count += 1
        written = ((v.name, own_copy(v).local_array) for _, v in pairs)  # read only under strict
        compare_copies(extended.collectives, written, f"{self._name}.apply_gradients")

    def _apply_dense(self, var: Variable, grad: Any, lr: float, step: int, *slots: Variable) -> None:
        """Update ``var`` and its ``slots`` (this rank's copies) from the summed ``grad``: a subclass
        that updates one variable at a time implements this."""
        raise NotImplementedError

    def _update_flat(self, w: Any, g: Any, slots: list[Any], lr: float, step: int) -> None:
        """Update matching 1-D blocks in place: weights ``w`` and ``slots`` (in ``slot_names``
        order) from the summed gradient ``g``, which is the optimizer's own to overwrite.

        A subclass that implements this runs on flat storage (see :mod:`mpistrat.training.optimizer_state`):
        every variable's block in a few vectorised passes, and ``shard_state=True`` works.
        """
        raise NotImplementedError


def _checked_rate(value: Any, name: str, where: str = "") -> float:
    """A learning rate as a float: a finite real number, else an error naming what came."""
    if isinstance(value, Variable):
        value = value.local_array
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value[()]
    ok = isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, (bool, np.bool_))
    if ok and math.isfinite(value):
        return float(value)
    got = f"a {type(value).__name__}" if not ok else repr(float(value))
    raise InvalidArgumentError(
        f"{name}: learning_rate{' ' + where if where else ''} must be a finite number (or a schedule "
        f"returning one); got {got}"
    )


class SGD(Optimizer):
    """Gradient descent with optional (Nesterov) momentum, as ``tf.keras.optimizers.SGD``.

    ``velocity = momentum * velocity - lr * g``; ``w += velocity`` (Nesterov:
    ``w += momentum * velocity - lr * g``); plain ``w -= lr * g`` when momentum is 0.
    ``shard_state=True`` keeps on each rank only its 1/R part of the velocity.
    """

    def __init__(
        self,
        learning_rate: float | Callable[[int], float] = 0.01,
        momentum: float = 0.0,
        nesterov: bool = False,
        name: str = "SGD",
        *,
        shard_state: bool = False,
        communication_options: CommunicationOptions | None = None,
        gradient_accumulation_steps: int | None = None,
    ):
        super().__init__(
            learning_rate,
            name,
            shard_state=shard_state,
            communication_options=communication_options,
            gradient_accumulation_steps=gradient_accumulation_steps,
        )
        if not 0.0 <= momentum <= 1.0:
            raise InvalidArgumentError(f"{name}: momentum must be in [0, 1]; got {momentum!r}")
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)
        self.slot_names = ("momentum",) if momentum else ()

    def _update_flat(self, w: Any, g: Any, slots: list[Any], lr: float, step: int) -> None:
        # In place, as a hand-written NumPy update would be, with g as the only temporary.
        g *= lr
        if not slots:
            w -= g
            return
        (velocity,) = slots
        velocity *= self.momentum
        velocity -= g
        if self.nesterov:  # w += momentum * velocity - lr * g
            w -= g
            packing.array_module(w).multiply(velocity, self.momentum, out=g)
            w += g
        else:
            w += velocity


class Adam(Optimizer):
    """Adam, as ``tf.keras.optimizers.Adam`` (bias correction folded into the step size).

    With ``t = step + 1``: ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``,
    ``w -= lr sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + epsilon)``.
    ``shard_state=True`` keeps on each rank only its 1/R part of ``m`` and ``v``.
    """

    slot_names = ("m", "v")

    def __init__(
        self,
        learning_rate: float | Callable[[int], float] = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        name: str = "Adam",
        *,
        shard_state: bool = False,
        communication_options: CommunicationOptions | None = None,
        gradient_accumulation_steps: int | None = None,
    ):
        super().__init__(
            learning_rate,
            name,
            shard_state=shard_state,
            communication_options=communication_options,
            gradient_accumulation_steps=gradient_accumulation_steps,
        )
        for what, beta in (("beta_1", beta_1), ("beta_2", beta_2)):
            if not 0.0 <= beta < 1.0:
                raise InvalidArgumentError(f"{name}: {what} must be in [0, 1); got {beta!r}")
        self.beta_1, self.beta_2, self.epsilon = float(beta_1), float(beta_2), float(epsilon)

    def _update_flat(self, w: Any, g: Any, slots: list[Any], lr: float, step: int) -> None:
        # In place, with g as the only temporary: 12 passes, no buffer of its own.
        m, v = slots
        t = step + 1
        b1, b2 = self.beta_1, self.beta_2
        lr_t = lr * math.sqrt(1.0 - b2**t) / (1.0 - b1**t)
        xp = packing.array_module(w)
        # Sums of like-signed terms only: g + b1 (m - g) would lose float32 digits to cancellation.
        m *= b1  # m = b1 m + (1 - b1) g
        g *= 1.0 - b1
        m += g
        xp.square(g, out=g)  # v = b2 v + (1 - b2) g^2, from ((1 - b1) g)^2
        g *= (1.0 - b2) / (1.0 - b1) ** 2
        v *= b2
        v += g
        xp.sqrt(v, out=g)  # w -= lr_t m / (sqrt(v) + epsilon)
        g += self.epsilon
        xp.divide(m, g, out=g)
        g *= lr_t
        w -= g

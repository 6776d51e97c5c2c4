"""The base of every optimizer: Keras 3's arguments, slots, the step counter and the distributed apply.

``apply_gradients`` runs in replica context (``strategy.run``) with this replica's gradients.
An optimizer with a flat update (``_update_flat``) keeps its variables and slots in flat
per-dtype buffers (``optimizer_state``): a step is one handshake, one in-place all-reduce of
the packed gradients per pack, and the update in a few vectorised passes. ``shard_state=True``:
each rank holds the slots of its 1/R of the parameters (ZeRO stage 1).
``gradient_accumulation_steps=K`` (Keras 3's): one update per K calls (``accumulation``).
Keras's base arguments (weight decay, clipping, EMA, a loss scale factor) are applied to the
summed gradient around the update (``base_arguments``). Scale each replica's loss by the *global* batch size.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import types
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from mpistrat.collectives.fingerprint import code_of
from mpistrat.collectives.sum_modes import EXACT, sum_mode
from mpistrat.comm import packing
from mpistrat.errors import ContextError, InvalidArgumentError
from mpistrat.interface import modes
from mpistrat.options import CommunicationOptions
from mpistrat.reduce_op import ReduceOp
from mpistrat.training import overlap
from mpistrat.training.accumulation import Accumulator, checked_steps, exact_rows
from mpistrat.training.base_arguments import BaseArguments, StepRule, overwrite_with_slot
from mpistrat.training.keras_arguments import KerasArguments
from mpistrat.training.learning_rate import LearningRate
from mpistrat.training.optimizer_checks import (
    SAME_BUILD,
    adopted_strategy,
    compare_copies,
    creation_scope,
    not_floating,
    own_replica_strategy,
)
from mpistrat.training.optimizer_state import FlatState, creation_order
from mpistrat.training.sharded_slot import ShardedSlot
from mpistrat.training.variables import Variable, VariableAggregation, Writable
from mpistrat.values import local_copy, local_variable

__all__ = ["Optimizer"]


class Optimizer(KerasArguments):
    """Base class: Keras's base arguments, slot bookkeeping, the step counter and the distributed apply.

    Subclasses name their slots in ``slot_names`` and implement one of:
    ``_update_flat(w, g, slots, lr, step)``, an in-place update of matching 1-D blocks (flat
    storage, one fused step, ``shard_state`` possible); or ``_apply_dense(var, grad, lr, step,
    *slots)``, which writes one variable and its slots (this rank's copies) given the summed
    gradient (``ReplicaContext.all_reduce``, then ``extended.update`` per variable). ``_slot_initial``
    gives a slot a starting value other than zero; ``trust_ratio = True`` (LAMB): the flat
    update leaves its direction in ``g``, and the step applies it scaled per variable.

    Keras 3's base arguments (keyword-only here): ``weight_decay``, ``clipnorm``, ``clipvalue``,
    ``global_clipnorm`` (at most one of the three), ``use_ema``, ``ema_momentum``,
    ``ema_overwrite_frequency``, ``loss_scale_factor``, ``gradient_accumulation_steps``; see
    :mod:`~mpistrat.training.base_arguments`. mpistrat's own: ``shard_state``,
    ``communication_options``.
    """

    slot_names: tuple[str, ...] = ()
    trust_ratio = False

    def __init__(
        self,
        learning_rate: float | Callable[[int], float],
        name: str,
        *,
        weight_decay: float | None = None,
        clipnorm: float | None = None,
        clipvalue: float | None = None,
        global_clipnorm: float | None = None,
        use_ema: bool = False,
        ema_momentum: float = 0.99,
        ema_overwrite_frequency: int | None = None,
        loss_scale_factor: float | None = None,
        gradient_accumulation_steps: int | None = None,
        shard_state: bool = False,
        communication_options: CommunicationOptions | None = None,
    ):
        self._base = BaseArguments.checked(
            name,
            weight_decay=weight_decay,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            use_ema=use_ema,
            ema_momentum=ema_momentum,
            ema_overwrite_frequency=ema_overwrite_frequency,
            loss_scale_factor=loss_scale_factor,
        )
        self._own_slots = len(self.slot_names)  # a subclass may set slot_names before this
        self._plain = not (self._base.any or self.trust_ratio)  # a step with nothing around the update
        if self._base.use_ema:
            self.slot_names = (*self.slot_names, "average")
        self._decays: dict[int, bool] = {}  # id(variable): whether weight decay applies, fixed at build
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
        self._rate = LearningRate(learning_rate, name)
        self._strategy = modes.get_strategy() if modes.has_strategy() else None
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
        if (self._base.any or self.trust_ratio) and not flat:
            raise InvalidArgumentError(
                f"{name}: Keras's base arguments (weight_decay, clipping, EMA, loss_scale_factor) need an "
                f"optimizer with a flat update (_update_flat); {type(self).__name__} updates one variable "
                "at a time (_apply_dense)"
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

    def _built(self) -> bool:
        return self._iterations is not None or bool(self._slots)

    def finalize_variable_values(self, var_list: Iterable[Variable] | None = None) -> None:
        """With ``use_ema``: set each variable of ``var_list`` (default: every variable this optimizer
        updates) to its moving average, as Keras does at the end of training. Collective: every rank
        calls it (sharded, each rank writes its part and the parameters are all-gathered)."""
        if not self._base.use_ema:
            return
        state = self._flat_state()
        assert state is not None
        wanted = None if var_list is None else {id(v) for v in var_list}
        if wanted is not None and (unknown := [v.name for v in var_list or () if id(v) not in state.where]):
            raise InvalidArgumentError(
                f"{self._name}.finalize_variable_values: no moving average for {unknown} (this optimizer "
                "has not updated them)"
            )
        collectives = None if self._strategy is None else self._strategy.extended.collectives
        overwrite_with_slot(state, "average", wanted, collectives, f"{self._name}.finalize_variable_values")

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
            with creation_scope(self._name, self._strategy):
                extended = modes.get_strategy().extended
                with extended.colocate_vars_with(extended.non_slot_devices([])):
                    self._iterations = Variable(
                        np.int64(0), trainable=False, name=f"{self._name}/iter",
                        aggregation=VariableAggregation.ONLY_FIRST_REPLICA,
                    )  # fmt: skip
                extended.collectives.recoverables.add(self._flat_state(), self._accumulator)  # after a death
        return self._iterations

    @property
    def learning_rate(self) -> Variable | float:
        """The learning rate, as Keras 3 has it: a number's variable (float64), or a schedule's value
        at the current ``iterations``.

        Settable between steps: a number (written into the variable; the next step uses it) or a
        schedule (a callable of the step, replacing the rate; a schedule's rate takes only another
        schedule, as in Keras). Every rank must set the same rate: the step's handshake compares them.

        >>> from mpistrat.optimizers import SGD
        >>> opt = SGD(0.1)
        >>> opt.learning_rate = 0.01
        >>> float(opt.learning_rate)
        0.01
        """
        step = 0 if self._iterations is None else local_variable(self._iterations).local_array
        return self._rate.read(int(step))  # this rank's count, without creating it

    @learning_rate.setter
    def learning_rate(self, value: float | Callable[[int], float]) -> None:
        self._rate.set(value)

    def tracked(self) -> dict[str, Variable]:
        """What a checkpoint saves besides the slots, by entry name: ``iterations`` and a number's
        ``learning_rate`` (a schedule is code: nothing to save)."""
        out = {"iterations": self.iterations}
        if self._rate.variable is not None:
            out["learning_rate"] = self._rate.variable
        return out

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
        if self._rate.variable is not None:
            out.append(self._rate.variable)
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
        for var in new:
            self._decays[id(var)] = bool(self._base.weight_decay) and self._use_weight_decay(var)
        if self._strategy is None:  # plain variables: the default strategy's, or the one in scope
            strategy, distributed = modes.get_strategy(), modes.has_strategy()
        else:
            strategy, distributed = self._strategy, True
        extended = strategy.extended
        bytes_per_pack = 0
        if distributed:
            collectives = extended.collectives
            merged = collectives.options.merge(self._communication_options)  # the optimizer's first
            bytes_per_pack, route = merged.bytes_per_pack, merged.implementation
            described = [
                ("optimizer", f"{type(self).__name__} with slots {list(self.slot_names)}", None),
                ("shard_state", str(self._shard_state), None),
                ("bytes_per_pack", str(bytes_per_pack), None),
                ("CommunicationOptions.implementation", route.value, None),
            ] + [(repr(v.name), self._described(v), v.shape) for v in new]
            collectives.agree(
                f"{self._name}.build",
                fingerprint=code_of(*described),
                describe=lambda: {"leaves": described, "advice": SAME_BUILD},
                error=not_floating(self._name, new),
            )
        elif (error := not_floating(self._name, new)) is not None:
            raise error
        slots = None if self._shard_state else self._slot_variables(new)
        before = len(state.groups)
        state.add(new, slots, ranks=extended.size, rank=extended.rank, bytes_per_pack=bytes_per_pack)
        if self._shard_state:
            for group in state.groups[before:]:
                for name in self.slot_names:
                    if (value := self._slot_initial(name)) != 0:
                        group.slots[name][...] = value
            for var in new:
                group, j = state.where[id(var)]
                slot = functools.partial(ShardedSlot, group, j, collectives=extended.collectives)
                self._slots[id(var)] = (var, {n: slot(n, f"{var.name}/{n}") for n in self.slot_names})

    def _slot_initial(self, slot_name: str) -> float:
        """The value slot ``slot_name`` starts from (zero; Adagrad's accumulator its own)."""
        return 0.0

    def _described(self, var: Variable) -> str:
        """A variable as ``build`` compares it between ranks (with whether it decays)."""
        decay = (
            "" if self._decays.get(id(var), True) == bool(self._base.weight_decay) else ", no weight decay"
        )
        return f"variable #{creation_order(var)} {var.dtype}{decay}"

    def _slot_variables(self, var_list: list[Variable]) -> dict[str, list[Variable]]:
        """Create each variable's slot variables (zeros, colocated with it); record and return them."""
        out: dict[str, list[Variable]] = {n: [] for n in self.slot_names}
        for var in var_list:
            with creation_scope(self._name, self._strategy):
                extended = modes.get_strategy().extended
                with extended.colocate_vars_with(var):
                    xp = packing.array_module(local_copy(var))
                    slots = {
                        n: Variable(
                            xp.full(var.shape, self._slot_initial(n), dtype=var.dtype),
                            trainable=False,
                            name=f"{var.name}/{n}",
                        )
                        for n in self.slot_names
                    }
            self._slots[id(var)] = (var, slots)
            for n, slot in slots.items():
                out[n].append(slot)
        return out

    def _adopt(self, var: Variable) -> None:
        """The optimizer's strategy is its variables' (or the one in scope when it was made)."""
        self._strategy = adopted_strategy(self._name, self._strategy, self._iterations is None, var)

    def apply_gradients(self, grads_and_vars: Any) -> Variable:
        """Apply one step from ``(gradient, variable)`` pairs, in replica context.

        Gradients are summed across replicas; pairs whose gradient is None are skipped. Returns
        ``iterations``. A generator of pairs overlaps the sums with itself (``training/overlap.py``).
        ``gradient_accumulation_steps=K``: K-1 of K calls keep the gradients; the K-th applies their mean.
        """
        self._apply(grads_and_vars, None)
        return self.iterations

    def _apply(self, grads_and_vars: Any, scaling: float | None) -> bool | None:
        """The step of :meth:`apply_gradients`; ``scaling``: a ``LossScaleOptimizer``'s scale, which
        divides the summed gradient, and whose step is skipped (False) where that sum is not
        finite. Returns whether the step was applied (None: a call that only accumulated)."""
        replica = modes.get_replica_context()
        if replica is None:
            raise ContextError(
                f"{self._name}.apply_gradients() cannot be called in cross-replica context; use "
                "strategy.run(fn) to enter replica context"
            )
        if isinstance(grads_and_vars, types.GeneratorType):  # computed as they come: their sums overlap
            accumulating, options = self._accumulator is not None, self._communication_options
            streamed = overlap.OptimizerView(
                self._name, self._strategy, self._state, options, accumulating, self._adopt,
                self._update_flat, self.iterations, self._rate.at,
                functools.partial(self._rule, scaling=scaling),
            )  # fmt: skip
            done = overlap.apply(streamed, grads_and_vars)
            if isinstance(done, bool):
                return done
            grads_and_vars = done
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
                return None
            pairs, rows = list(zip(kept, variables, strict=True)), (acc.steps if acc.rows else 0)
            pending = acc.take_pending()
            if pending is not None and (state is None or strategy is None):
                acc.drop()
                raise pending
        with contextlib.nullcontext() if acc is None else acc.applying(strategy):
            if state is None:  # one variable at a time, without merge_call (Keras's path)
                self._apply_each(replica, pairs)
                return True
            counter = local_variable(self.iterations)
            step = int(counter.local_array)
            lr, bad_rate = self._rate.at(step)
            rule = self._rule(lr, step, scaling)
            applied = state.step(
                None if strategy is None else strategy.extended.collectives,
                [g for g, _ in pairs],
                variables,
                self._update_flat if rule is None else rule.update,
                lr,
                step,
                plan=plan,
                options=self._communication_options,
                pending=pending or bad_rate,
                rows=rows,
                rule=rule,
            )
        if applied:
            with Writable(counter) as count:  # this rank's copy: every rank counts the same steps
                count += 1
        return applied

    def _rule(self, lr: float, step: int, scaling: float | None) -> StepRule | None:
        """What the base arguments (and a loss scale's ``scaling``) add to the step at ``step``;
        None when nothing: the plain update."""
        if self._plain and scaling is None:
            return None
        collectives = None if self._strategy is None else self._strategy.extended.collectives
        sharded = self._shard_state and collectives is not None and collectives.size > 1
        exact = (
            collectives is not None
            and sum_mode(collectives.options.merge(self._communication_options)) is EXACT
        )
        kept = (self._update_flat, self._own_slots, self._decays, self.trust_ratio)
        return StepRule(self._base, *kept, lr, step, collectives, sharded, exact, scaling)

    def accumulation_state(self) -> tuple[Variable, list[tuple[Variable, Any]]] | None:
        """Mid-cycle: what a checkpoint saves of it (:meth:`Accumulator.state`); else None."""
        extended = (self._strategy or modes.get_strategy()).extended
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
        extended, options = replica.strategy.extended, self._communication_options
        summed = replica.all_reduce(ReduceOp.SUM, [g for g, _ in pairs], options)
        counter = local_variable(self.iterations)
        step = int(counter.local_array)
        lr, bad_rate = self._rate.at(step)
        if bad_rate is not None:  # a schedule's value: every rank computes the same
            raise bad_rate
        for grad, (_, var) in zip(summed, pairs, strict=True):
            slots = self._slots[id(var)][1]
            extended.update(
                var, self._apply_dense, args=(grad, lr, step, *(slots[n] for n in self.slot_names))
            )
        with Writable(counter) as count:  # this rank's copy: every rank counts the same steps
            count += 1
        extended.collectives.commits += 1  # applied here: what a recovery goes on from
        written = ((v.name, local_variable(v).local_array) for _, v in pairs)  # read only under strict
        compare_copies(extended.collectives, written, f"{self._name}.apply_gradients", options)

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

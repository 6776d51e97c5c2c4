"""Keras 3's base optimizer arguments as an optimizer answers to them: attributes, exclusions, config.

:class:`KerasArguments` is what :class:`~mpistrat.training.optimizer_base.Optimizer` takes from
Keras's ``Optimizer`` besides the step: the base arguments read as attributes
(``opt.weight_decay``, ``opt.clipnorm``, ...), ``exclude_from_weight_decay``, and
``get_config()`` / ``from_config()`` (the learning rate a number or a serialised schedule).
What a step does with the arguments is :mod:`~mpistrat.training.base_arguments`.

>>> from mpistrat.optimizers import Adam
>>> Adam(0.1, clipnorm=1.0).get_config()["clipnorm"]
1.0
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Any

from mpistrat.errors import InvalidArgumentError
from mpistrat.training import schedules
from mpistrat.training.base_arguments import BaseArguments
from mpistrat.training.learning_rate import LearningRate
from mpistrat.training.variables import Variable

__all__ = ["KerasArguments"]


class KerasArguments:
    """The base arguments' attributes, weight-decay exclusions and config of an optimizer."""

    _base: BaseArguments
    _name: str
    _rate: LearningRate
    _shard_state: bool
    _config_names: tuple[str, ...] = ()  # a subclass's own arguments, as get_config names them
    _excluded_ids: frozenset[int] = frozenset()
    _excluded_names: re.Pattern[str] | None = None

    @property
    def gradient_accumulation_steps(self) -> int | None:
        raise NotImplementedError

    def _built(self) -> bool:
        raise NotImplementedError

    weight_decay = property(lambda self: self._base.weight_decay, doc="Decoupled weight decay (None: off).")
    clipnorm = property(
        lambda self: self._base.clipnorm, doc="Each variable's gradient clipped to this norm."
    )
    clipvalue = property(lambda self: self._base.clipvalue, doc="Each gradient value clipped to +-this.")
    global_clipnorm = property(
        lambda self: self._base.global_clipnorm,
        doc="Every gradient scaled so that their joint norm is at most this.",
    )
    use_ema = property(
        lambda self: self._base.use_ema, doc="Whether a moving average of the weights is kept."
    )
    ema_momentum = property(lambda self: self._base.ema_momentum, doc="The moving average's momentum.")
    ema_overwrite_frequency = property(
        lambda self: self._base.ema_overwrite_frequency,
        doc="Every this many steps the weights become the average.",
    )
    loss_scale_factor = property(
        lambda self: self._base.loss_scale_factor, doc="Gradients are divided by this before anything else."
    )

    def exclude_from_weight_decay(
        self, var_list: Iterable[Variable] | None = None, var_names: Iterable[str] | None = None
    ) -> None:
        """Leave out of weight decay the variables of ``var_list`` and those whose name contains one
        of ``var_names`` (a regular expression each, as Keras searches them). Before the first step
        or ``build``, as in Keras; every rank must exclude the same variables (``build`` compares)."""
        if self._built():
            raise InvalidArgumentError(
                f"{self._name}: exclude_from_weight_decay() can only be configured before the optimizer is "
                "built (its first apply_gradients or build)"
            )
        self._excluded_ids = frozenset(id(v) for v in var_list or ())
        names = sorted(set(var_names or ()))
        if any(not isinstance(n, str) for n in names):
            raise InvalidArgumentError(f"{self._name}: var_names must be strings; got {names!r}")
        self._excluded_names = re.compile("|".join(names)) if names else None

    def _use_weight_decay(self, var: Variable) -> bool:
        if id(var) in self._excluded_ids:
            return False
        return self._excluded_names is None or self._excluded_names.search(var.name) is None

    def get_config(self) -> dict[str, Any]:
        """This optimizer's arguments, as Keras's ``get_config()`` gives them (a schedule serialised)."""
        base = dataclasses.asdict(self._base)
        own = {name: getattr(self, name) for name in self._config_names}
        return {
            "name": self._name,
            "learning_rate": self._rate.config(),
            **own,
            **base,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "shard_state": self._shard_state,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Any:
        """The optimizer :meth:`get_config` described (``learning_rate`` a schedule's config or a number)."""
        config = dict(config)
        if isinstance(config.get("learning_rate"), dict):
            config["learning_rate"] = schedules.deserialize(config["learning_rate"])
        return cls(**config)

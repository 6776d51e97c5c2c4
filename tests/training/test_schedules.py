"""``mpistrat.optimizers.schedules`` against Keras 3's: values at steps 0 to 40 and configs.

The values and configs are Keras's own, recorded in ``data/keras_optimizers.json`` by
``data/make_keras_fixtures.py`` (Keras computes in float32: 1e-6 relative). An optimizer made
with a schedule applies its value at ``iterations`` (the Keras optimizer fixtures' ``schedule``
cases); a config saved with an optimizer's makes the same schedule again.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

import mpistrat
from mpistrat import InvalidArgumentError
from mpistrat.optimizers import SGD, Adam, schedules
from tests.training.data import make_keras_fixtures as made

FIXTURES = json.loads((pathlib.Path(__file__).parent / "data" / "keras_optimizers.json").read_text())
KERAS = FIXTURES["schedules"]


@pytest.mark.parametrize("name", sorted(made.SCHEDULES))
def test_values_and_config_match_keras(name):
    cls, args = made.SCHEDULES[name]
    schedule = getattr(schedules, cls)(**args)
    got = np.array([schedule(step) for step in range(made.SCHEDULE_STEPS)])
    want = np.array(KERAS[name]["values"])
    assert np.allclose(got, want, rtol=1e-6, atol=1e-8), np.abs(got - want).max()
    assert schedule.get_config() == KERAS[name]["config"]
    again = schedules.deserialize(json.loads(json.dumps(schedules.serialize(schedule))))
    assert type(again) is type(schedule) and again.get_config() == schedule.get_config()
    assert [again(s) for s in range(made.SCHEDULE_STEPS)] == got.tolist()
    assert type(schedule).from_config(schedule.get_config()) == schedule


def test_bad_arguments_name_what_was_expected():
    with pytest.raises(InvalidArgumentError, match=r"decay_steps must be a number > 0; got 0"):
        schedules.ExponentialDecay(0.1, decay_steps=0, decay_rate=0.5)
    with pytest.raises(InvalidArgumentError, match=r"decay_rate must be a number >= 0\.0; got -0\.5"):
        schedules.InverseTimeDecay(0.1, decay_steps=3, decay_rate=-0.5)
    with pytest.raises(InvalidArgumentError, match="one more element than boundaries"):
        schedules.PiecewiseConstantDecay([1, 2], [0.1, 0.2])
    with pytest.raises(InvalidArgumentError, match="initial_learning_rate must be a number; got nan"):
        schedules.CosineDecay(float("nan"), 10)
    with pytest.raises(InvalidArgumentError, match="unknown schedule 'Nope'"):
        schedules.deserialize({"class_name": "Nope", "config": {}})


def test_an_optimizers_config_carries_its_schedule_and_makes_it_again():
    schedule = schedules.CosineDecay(0.0, 25, warmup_target=0.2, warmup_steps=8)
    opt = Adam(schedule, beta_1=0.8, clipnorm=1.0, use_ema=True)
    config = json.loads(json.dumps(opt.get_config()))  # plain JSON, as Keras saves it
    assert config["learning_rate"] == schedules.serialize(schedule) and config["beta_1"] == 0.8
    again = Adam.from_config(config)
    assert again.get_config() == opt.get_config() and again.clipnorm == 1.0 and again.use_ema
    plain = SGD(0.1, momentum=0.9, weight_decay=0.01)
    assert SGD.from_config(plain.get_config()).get_config() == plain.get_config()


def test_the_rate_of_a_schedule_follows_iterations(group):
    schedule = schedules.PiecewiseConstantDecay([1], [0.5, 0.25])
    with group.strategy.scope():
        w = mpistrat.Variable(np.zeros(2), name="w")
        opt = SGD(schedule)
    rates = []
    for _ in range(3):
        rates.append(float(opt.learning_rate))
        group.strategy.run(lambda: opt.apply_gradients([(np.ones(2), w)]))
    # steps 0 and 1 at 0.5, step 2 at 0.25: each rank gave ones
    assert rates == [0.5, 0.5, 0.25] and np.allclose(w.numpy(), -1.25 * group.size)

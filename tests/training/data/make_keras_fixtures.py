"""How keras_optimizers.json here was made: Keras 3's own optimizers, 20 steps of fixed gradients.

Run outside the project, in a scratch environment with Keras and a backend that trains (Keras
is never a dependency of mpistrat)::

    python3 -m venv /tmp/kerasref && /tmp/kerasref/bin/pip install keras jax jaxlib
    KERAS_BACKEND=jax /tmp/kerasref/bin/python tests/training/data/make_keras_fixtures.py \
        tests/training/data/keras_optimizers.json

Every case starts from the same float32 variables and applies the same 20 gradients
(:func:`gradients`); the file holds, per case, the weights and each slot after the last step
(and, with EMA, the weights after ``finalize_variable_values``), with the Keras version.
``tests/training/test_keras_optimizers.py`` repeats each case with mpistrat and compares. The
file also holds each schedule of :data:`SCHEDULES` at steps 0 to 40 and its ``get_config()``
(``tests/training/test_schedules.py``), and Keras's public names (``tests/test_migrating.py``).
"""

from __future__ import annotations

import json
import sys

import numpy as np

STEPS = 20
SHAPES = {"dense/kernel": (3, 4), "dense/bias": (4,), "norm/gamma": (5,)}

# optimizer name -> (Keras class, its arguments); learning rates large enough to move the weights
OPTIMIZERS = {
    "sgd": ("SGD", {"learning_rate": 0.05}),
    "sgd_momentum": ("SGD", {"learning_rate": 0.05, "momentum": 0.9}),
    "sgd_nesterov": ("SGD", {"learning_rate": 0.05, "momentum": 0.9, "nesterov": True}),
    "adam": ("Adam", {"learning_rate": 0.01}),
    "adam_amsgrad": ("Adam", {"learning_rate": 0.01, "amsgrad": True}),
    "adamw": ("AdamW", {"learning_rate": 0.01, "weight_decay": 0.05}),
    "rmsprop": ("RMSprop", {"learning_rate": 0.01}),
    "rmsprop_momentum": ("RMSprop", {"learning_rate": 0.01, "momentum": 0.9}),
    "rmsprop_centered": ("RMSprop", {"learning_rate": 0.01, "centered": True}),
    "rmsprop_momentum_centered": ("RMSprop", {"learning_rate": 0.01, "momentum": 0.5, "centered": True}),
    "adagrad": ("Adagrad", {"learning_rate": 0.05}),
    "lamb": ("Lamb", {"learning_rate": 0.01}),
}

# base argument -> the arguments it adds (weight_decay also excludes the variables named "bias")
BASE = {
    "plain": {},
    "weight_decay": {"weight_decay": 0.1},
    "clipnorm": {"clipnorm": 1.0},
    "clipvalue": {"clipvalue": 0.5},
    "global_clipnorm": {"global_clipnorm": 1.5},
    "ema": {"use_ema": True, "ema_momentum": 0.9},
    "ema_overwrite": {"use_ema": True, "ema_momentum": 0.8, "ema_overwrite_frequency": 5},
    "loss_scale_factor": {"loss_scale_factor": 128.0},
    "schedule": {},  # learning_rate=ExponentialDecay(lr, decay_steps=5, decay_rate=0.5)
    "gradient_accumulation_steps": {"gradient_accumulation_steps": 2},
}
LOSS_SCALE = 128.0

# each optimizer's Keras slot lists, by the names mpistrat gives them
SLOTS = {
    "SGD": {"momentum": "momentums"},
    "Adam": {"m": "_momentums", "v": "_velocities", "vhat": "_velocity_hats"},
    "AdamW": {"m": "_momentums", "v": "_velocities"},
    "RMSprop": {
        "velocity": "_velocities",
        "momentum": "_momentums",
        "average_gradient": "_average_gradients",
    },
    "Adagrad": {"accumulator": "_accumulators"},
    "Lamb": {"m": "_momentums", "v": "_velocities"},
}


# schedule name -> (Keras class, its arguments)
SCHEDULES = {
    "exponential": ("ExponentialDecay", {"initial_learning_rate": 0.1, "decay_steps": 7, "decay_rate": 0.5}),
    "exponential_staircase": (
        "ExponentialDecay",
        {"initial_learning_rate": 0.1, "decay_steps": 7, "decay_rate": 0.5, "staircase": True},
    ),
    "piecewise": ("PiecewiseConstantDecay", {"boundaries": [5, 12, 30], "values": [1.0, 0.5, 0.1, 0.01]}),
    "polynomial": ("PolynomialDecay", {"initial_learning_rate": 0.1, "decay_steps": 25, "power": 2.0}),
    "polynomial_cycle": (
        "PolynomialDecay",
        {
            "initial_learning_rate": 0.1,
            "decay_steps": 9,
            "end_learning_rate": 0.01,
            "power": 0.5,
            "cycle": True,
        },
    ),
    "inverse_time": ("InverseTimeDecay", {"initial_learning_rate": 0.1, "decay_steps": 4, "decay_rate": 0.3}),
    "inverse_time_staircase": (
        "InverseTimeDecay",
        {"initial_learning_rate": 0.1, "decay_steps": 4, "decay_rate": 0.3, "staircase": True},
    ),
    "cosine": ("CosineDecay", {"initial_learning_rate": 0.1, "decay_steps": 30, "alpha": 0.1}),
    "cosine_warmup": (
        "CosineDecay",
        {"initial_learning_rate": 0.0, "decay_steps": 25, "warmup_target": 0.2, "warmup_steps": 8},
    ),
    "cosine_restarts": ("CosineDecayRestarts", {"initial_learning_rate": 0.1, "first_decay_steps": 6}),
    "cosine_restarts_flat": (
        "CosineDecayRestarts",
        {"initial_learning_rate": 0.1, "first_decay_steps": 5, "t_mul": 1.0, "m_mul": 0.8, "alpha": 0.05},
    ),
}
SCHEDULE_STEPS = 41


def initial() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(2024)
    return {n: rng.normal(size=s).astype(np.float32) for n, s in SHAPES.items()}


def gradients(step: int) -> dict[str, np.ndarray]:
    """Step ``step``'s gradients: normal, scaled so that some steps clip and others do not."""
    rng = np.random.default_rng([7, step])
    scale = [0.2, 3.0, 1.0, 0.5][step % 4]
    return {n: (scale * rng.normal(size=s)).astype(np.float32) for n, s in SHAPES.items()}


def run(keras, optimizer: str, base: str) -> dict[str, list[float]]:
    cls, args = OPTIMIZERS[optimizer]
    args = {**args, **BASE[base]}
    if base == "schedule":
        args["learning_rate"] = keras.optimizers.schedules.ExponentialDecay(
            args["learning_rate"], decay_steps=5, decay_rate=0.5
        )
    opt = getattr(keras.optimizers, cls)(**args)
    variables = {n: keras.Variable(v, name=n.split("/")[1]) for n, v in initial().items()}
    if base == "weight_decay":
        opt.exclude_from_weight_decay(var_names=["bias"])
    order = list(SHAPES)
    for t in range(STEPS):
        g = gradients(t)
        scale = LOSS_SCALE if base == "loss_scale_factor" else 1.0
        opt.apply_gradients([(g[n] * np.float32(scale), variables[n]) for n in order])
    out = {n: np.asarray(variables[n]).ravel().tolist() for n in order}
    for name, attribute in SLOTS[cls].items():
        held = getattr(opt, attribute, None)
        if held:
            out |= {f"{n}/{name}": np.asarray(s).ravel().tolist() for n, s in zip(order, held, strict=True)}
    if opt.use_ema:
        averages = opt._model_variables_moving_average
        out |= {f"{n}/average": np.asarray(a).ravel().tolist() for n, a in zip(order, averages, strict=True)}
        opt.finalize_variable_values([variables[n] for n in order])
        out |= {f"{n}/finalized": np.asarray(variables[n]).ravel().tolist() for n in order}
    return out


def names(keras) -> dict[str, list[str]]:
    """Keras's public optimizers and schedules, and the base optimizer's arguments (docs/migrating.md
    answers for each)."""
    import inspect

    public = lambda module: sorted(n for n in dir(module) if not n.startswith("_"))  # noqa: E731
    return {
        "optimizers": public(keras.optimizers),
        "schedules": public(keras.optimizers.schedules),
        "arguments": list(inspect.signature(keras.optimizers.Optimizer).parameters),
    }


def main(path: str) -> None:
    import keras

    cases = {f"{o}/{b}": run(keras, o, b) for o in OPTIMIZERS for b in BASE}
    schedules = {}
    for name, (cls, args) in SCHEDULES.items():
        schedule = getattr(keras.optimizers.schedules, cls)(**args)
        values = [float(schedule(step)) for step in range(SCHEDULE_STEPS)]
        schedules[name] = {"values": values, "config": schedule.get_config()}
    document = {
        "keras": keras.__version__,
        "backend": keras.backend.backend(),
        "steps": STEPS,
        "cases": cases,
        "schedules": schedules,
        "names": names(keras),
    }
    with open(path, "w") as f:
        json.dump(document, f, indent=0, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])

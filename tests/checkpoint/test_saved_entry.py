"""Each kind of value a checkpoint saves answers every member of its protocol
(``mpistrat/interface/saved_entry.py``): the save and the restore read nothing else of it."""

import numpy as np

import mpistrat
from mpistrat.input.datasets import input_position
from mpistrat.interface import saved_entry
from mpistrat.optimizers import SGD
from mpistrat.training.saved_variable import SavedVariable
from tests.conftest import RankChecks


def members(protocol: type) -> set[str]:
    return {name for name in vars(protocol) if not name.startswith("_")}


def test_every_kind_answers_each_member_of_its_protocol(group):
    strategy = group.strategy
    with strategy.scope():
        w = mpistrat.Variable(np.zeros(4, np.float32))
        sharded = SGD(0.1, momentum=0.9, shard_state=True)
        accumulating = SGD(0.1, gradient_accumulation_steps=2)
    pairs = [(np.ones(4, np.float32), w)]
    strategy.run(lambda: sharded.apply_gradients(pairs))
    strategy.run(lambda: accumulating.apply_gradients(pairs))  # the first of 2 calls: a cycle in progress
    ((_, row),) = accumulating.accumulation_state()[1]
    data = mpistrat.ArrayDataset(np.zeros((8, 1), np.float32), 4)
    kinds = [
        (SavedVariable(w), saved_entry.WholeEntry, saved_entry.WHOLE),
        (sharded.get_slot(w, "momentum"), saved_entry.PartsEntry, saved_entry.PARTS),
        (row, saved_entry.PartsEntry, saved_entry.PARTS),
        (input_position(iter(strategy.experimental_distribute_dataset(data))), saved_entry.PositionEntry,
         saved_entry.POSITION),
    ]  # fmt: skip
    checks = RankChecks()
    for entry, protocol, holding in kinds:
        missing = members(protocol) - set(dir(entry))
        checks.that(not missing and entry.holding == holding, f"{type(entry).__name__}: {sorted(missing)}")
    checks.that(members(saved_entry.PartsEntry) >= {"holding", "shape", "dtype", "layout", "local_parts"})
    checks.agree(group.comm, "")

"""mpistrat.nest follows tf.nest: sorted dict keys, None as a leaf, namedtuples kept."""

import collections

import pytest

from mpistrat import nest

Point = collections.namedtuple("Point", "x y")


def test_flatten_sorts_dict_keys_and_keeps_none():
    assert nest.flatten({"b": [1, None], "a": (2, 3)}) == [2, 3, 1, None]


def test_pack_sequence_as_round_trips_namedtuples():
    structure = {"p": Point(1, [2, 3]), "q": 4}
    packed = nest.pack_sequence_as(structure, [10, 20, 30, 40])
    assert packed == {"p": Point(10, [20, 30]), "q": 40}
    assert type(packed["p"]) is Point


def test_map_structure_over_two_nests():
    assert nest.map_structure(lambda a, b: a + b, [1, (2,)], [10, (20,)]) == [11, (22,)]


def test_assert_same_structure_names_the_difference():
    with pytest.raises(ValueError, match=r"\['b'\]"):
        nest.assert_same_structure({"a": 1, "b": [1, 2]}, {"a": 1, "b": [1]})


def test_flatten_with_paths():
    assert nest.flatten_with_paths({"a": [5, 6]}) == [(("a", 0), 5), (("a", 1), 6)]


def test_pack_sequence_as_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="2 leaves"):
        nest.pack_sequence_as([1, 2], [1])

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


# tf.nest.assert_same_structure (TensorFlow 2.21): a different container type is a TypeError
# (check_types=True, the default), a mapping counts as one type whatever its class; a different
# length, different keys or a leaf for a container is a ValueError; with check_types=False
# only the leaves under each container count, so list/tuple, dict/list and dicts with other keys pass.
@pytest.mark.parametrize(
    "nest1, nest2, check_types, error",
    [
        ([1, 2], (1, 2), True, TypeError),
        ([1, 2], (1, 2), False, None),
        ((1, 2), Point(1, 2), True, TypeError),
        ((1, 2), Point(1, 2), False, None),
        ({"a": 1}, collections.OrderedDict(a=1), True, None),
        ({"a": 1}, [1], True, TypeError),
        ({"a": 1}, [1], False, None),
        ({"a": 1}, {"b": 1}, True, ValueError),
        ({"a": 1}, {"b": 1}, False, None),
        ([1, 2], [1], True, ValueError),
        (1, [1], True, ValueError),
        ({"a": [1]}, {"a": (1,)}, True, TypeError),
        ([None], [1], True, None),
    ],
)
def test_assert_same_structure_raises_as_tf_nest(nest1, nest2, check_types, error):
    if error is None:
        nest.assert_same_structure(nest1, nest2, check_types=check_types)
    else:
        with pytest.raises(error, match="same nested structure") as info:
            nest.assert_same_structure(nest1, nest2, check_types=check_types)
        other = ValueError if error is TypeError else TypeError
        assert not isinstance(info.value, other)


def test_map_structure_check_types_as_tf_nest():
    # tf.nest.map_structure(lambda x, y: x + y, [1], (2,), check_types=False) == [3]; with the
    # default check_types=True it raises TypeError.
    assert nest.map_structure(lambda x, y: x + y, [1], (2,), check_types=False) == [3]
    with pytest.raises(TypeError):
        nest.map_structure(lambda x, y: x + y, [1], (2,))


def test_ordered_dict_flattens_in_insertion_order_unlike_tf_nest():
    # A documented difference: tf.nest.flatten(OrderedDict(b=1, a=2)) == [2, 1] (sorted keys);
    # optree, and so mpistrat.nest, keeps the insertion order. Both rebuild the same OrderedDict.
    ordered = collections.OrderedDict([("b", 1), ("a", 2)])
    assert nest.flatten(ordered) == [1, 2]
    assert nest.pack_sequence_as(ordered, nest.flatten(ordered)) == ordered


def test_map_structure_pairs_a_dict_and_an_ordered_dict_by_key():
    # tf.nest.map_structure(lambda a, b: (a, b), {"b": 1, "a": 2}, OrderedDict(b=10, a=20))
    # == {"a": (2, 20), "b": (1, 10)}: tf sorts every mapping's keys.
    got = nest.map_structure(lambda a, b: (a, b), {"b": 1, "a": 2}, collections.OrderedDict(b=10, a=20))
    assert got == {"a": (2, 20), "b": (1, 10)}
    got = nest.map_structure(
        lambda a, b: a + b, {"b": 1, "a": 2}, collections.OrderedDict(b=10, a=20), check_types=False
    )
    assert got == {"a": 22, "b": 11}


def test_without_check_types_mappings_pair_by_sorted_key():
    # tf.nest.map_structure(lambda a, b: (a, b), {"a": 1, "c": 2}, {"b": 10, "d": 20},
    # check_types=False) == {"a": (1, 10), "c": (2, 20)}: keys may differ, sorted order pairs them.
    got = nest.map_structure(lambda a, b: (a, b), {"a": 1, "c": 2}, {"b": 10, "d": 20}, check_types=False)
    assert got == {"a": (1, 10), "c": (2, 20)}


@pytest.mark.parametrize("rest", [None, 5, [1, (2, None)], {"a": 1}])
def test_tree_map_of_one_leaf_is_optree_tree_map(rest):
    """A value of LEAF_TYPES is mapped without a walk: the same as optree's map, rests whole."""
    import numpy as np
    import optree

    for leaf in (np.ones(2), None, True, 3, 2.5, np.float32(1), np.float64(2), np.int32(3), np.int64(4)):
        assert type(leaf) in nest.LEAF_TYPES
        want = optree.tree_map(lambda x, r: (x, r), leaf, rest, none_is_leaf=True, namespace="mpistrat")
        got = nest.tree_map(lambda x, r: (x, r), leaf, rest)
        assert got[0] is want[0] and got[1] == want[1]
        assert optree.tree_structure(leaf, none_is_leaf=True, namespace="mpistrat").is_leaf()

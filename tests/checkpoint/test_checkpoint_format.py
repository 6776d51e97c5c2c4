"""The checkpoint file: standard safetensors (read back by the safetensors package), its checksums,
what is checked before anything is restored, and format-1 files of the previous version."""

import itertools
import json
import os
import struct
import threading
import zipfile
import zlib
from pathlib import Path

import crc32c
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import mpistrat
from mpistrat import InvalidArgumentError
from mpistrat.checkpoint import crc, restoring, saving
from mpistrat.checkpoint.files import read_table
from mpistrat.checkpoint.pieces import Piece, calls, share, spans_of_share
from mpistrat.optimizers import Adam
from tests.checkpoint.test_checkpoint import shared_dir
from tests.conftest import RankChecks, all_ranks_agree, raises_on_every_rank

FORMAT1 = Path(__file__).parent / "data" / "format1"
FORMAT2 = Path(__file__).parent / "data" / "format2"
FORMAT2_CRC32 = Path(__file__).parent / "data" / "format2-crc32"
DTYPES = ["float32", "float64", "float16", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64"]
DTYPES += ["uint64", "complex64"]  # every dtype a variable may have (no bool)


# -- the arithmetic: checksums of parts, shares, calls ------------------------------------------


# The independent references: zlib's CRC-32 and the crc32c wheel's CRC-32C (Intel's instruction).
REFERENCES = [(crc.CRC32, zlib.crc32), (crc.CRC32C, crc32c.crc32c)]


@pytest.mark.parametrize(("checksum", "reference"), REFERENCES, ids=["crc32", "crc32c"])
@given(parts=st.lists(st.binary(max_size=300), max_size=6))
def test_the_checksum_of_parts_is_the_references_checksum_of_the_whole(checksum, reference, parts):
    whole = b"".join(parts)
    starts = np.cumsum([0, *map(len, parts)]).tolist()
    records = [(s, reference(p), len(p)) for s, p in zip(starts, parts, strict=False)]
    assert checksum.joined(records[::-1], len(whole)) == reference(whole)


@pytest.mark.parametrize(("checksum", "reference"), REFERENCES, ids=["crc32", "crc32c"])
def test_parts_that_do_not_tile_the_whole_have_no_checksum(checksum, reference):
    a, b = b"abcd", b"efgh"
    assert checksum.joined([(0, reference(a), 4)], 8) is None  # a gap
    assert checksum.joined([(0, reference(a), 4), (2, reference(b), 4)], 8) is None  # an overlap
    assert checksum.joined([(0, reference(a + b), 8), (0, reference(a), 4)], 8) is None  # counted twice


@pytest.mark.parametrize(("checksum", "reference"), REFERENCES, ids=["crc32", "crc32c"])
def test_the_numpy_checksum_without_the_wheel_is_the_references(checksum, reference):
    """What a save computes where the crc32c wheel is missing: the same values, lanes and tails of
    every length around the lanes' edges, extending a previous value."""
    numpy_only = crc.Checksum(checksum.key, checksum.name, checksum._polynomial)
    rng = np.random.default_rng(5)
    lanes = numpy_only._LANES
    for n in [0, 1, 7, lanes - 1, lanes, lanes + 1, 3 * lanes + 5, 300 * lanes + 11]:
        data, value = rng.integers(0, 256, n, dtype=np.uint8), int(rng.integers(0, 2**32))
        assert numpy_only(data.data, value) == reference(data.tobytes(), value), n


@pytest.mark.serial("one process: the checksum's arithmetic, not the ranks")
def test_without_the_crc32c_wheel_a_checkpoint_saves_and_restores_the_same_file(tmp_path, monkeypatch):
    """Where the wheel is missing the NumPy version runs: the file's checksums are the wheel's, and it
    restores (and a flipped byte is still found)."""
    monkeypatch.setattr(crc.CRC32C, "_update", crc.CRC32C._numpy)
    w = mpistrat.Variable(np.arange(70_001, dtype=np.float32), name="w")
    path = mpistrat.Checkpoint(w=w).write(tmp_path / "ckpt")
    checksums = json.loads(header_of(path)[0]["__metadata__"]["crc32c"])
    assert int(checksums["w"], 16) == crc32c.crc32c(w.numpy().tobytes())
    w.assign(np.zeros(70_001, np.float32))
    mpistrat.Checkpoint(w=w).read(path).assert_consumed()
    assert np.array_equal(w.numpy(), np.arange(70_001, dtype=np.float32))
    content = bytearray(Path(path).read_bytes())
    content[-5] ^= 1
    Path(path).write_bytes(bytes(content))
    with pytest.raises(InvalidArgumentError, match="checksum mismatch in w"):
        mpistrat.Checkpoint(w=w).read(path)


@given(st.integers(0, 10**6), st.integers(1, 64))
def test_shares_split_every_byte_once_and_evenly(total, size):
    bounds = [share(total, size, r) for r in range(size)]
    assert bounds[0][0] == 0 and bounds[-1][1] == total
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    lengths = [hi - lo for lo, hi in bounds]
    assert max(lengths) - min(lengths) <= 1


@given(st.lists(st.integers(0, 50), max_size=8), st.integers(0, 400), st.integers(0, 400))
def test_a_share_of_arrays_laid_end_to_end_is_their_bytes_in_that_range(sizes, lo, hi):
    data = np.arange(sum(sizes)) % 251
    arrays = np.split(data, np.cumsum(sizes)[:-1]) if sizes else []
    got = [arrays[i][a:b] for i, a, b in spans_of_share(sizes, lo, hi)]
    want = data[lo:hi]
    assert np.array_equal(np.concatenate(got) if got else np.zeros(0), want)


@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 40)), max_size=10), st.integers(1, 64))
def test_calls_join_consecutive_bytes_up_to_the_limit_and_keep_every_byte(spans, limit):
    used, pieces = set(), []
    for offset, length in spans:
        if not set(range(offset, offset + length)) & used:
            used |= set(range(offset, offset + length))
            pieces.append(
                Piece("e", offset, offset, (np.arange(offset, offset + length) % 256).astype(np.uint8))
            )
    got = calls(pieces, limit)
    flat = [p for call in got for p in call]
    assert sorted(b for p in flat for b in range(p.offset, p.offset + p.nbytes)) == sorted(used)
    for call in got:
        assert sum(p.nbytes for p in call) <= limit
        assert all(a.offset + a.nbytes == b.offset for a, b in itertools.pairwise(call))
        assert all(np.array_equal(p.memory, np.arange(p.offset, p.offset + p.nbytes) % 256) for p in call)


# -- where a restore checksums: beside its reads with a core to spare, else after each ------------


@pytest.mark.parametrize(
    ("cores", "mine", "ranks", "spare"),
    [
        (2, 2, 2, False),
        (2, 2, 1, True),
        (16, 16, 4, True),
        (16, 16, 9, False),
        (16, 1, 4, False),
        (16, 2, 4, True),
    ],
)
def test_a_rank_has_a_spare_core_bound_to_two_or_sharing_twice_its_nodes_ranks(
    monkeypatch, cores, mine, ranks, spare
):
    monkeypatch.setattr(crc.os, "cpu_count", lambda: cores)
    monkeypatch.setattr(crc.os, "sched_getaffinity", lambda _: set(range(mine)), raising=False)
    hosts = ["here"] * ranks + ["there"] * 5  # the other node's ranks change nothing here
    assert crc.spare_core(hosts, ranks - 1) is spare
    assert crc.spare_core([], 0) is (mine >= 2)  # no host known: alone on its node


def flipped_in_data(group, path, name):
    """A copy of ``path`` with a byte of entry ``name``'s data flipped (rank 0 writes it)."""
    bad = path + ".flipped"
    if group.rank == 0:
        entry = read_table(path).entries[name]
        data = bytearray(Path(path).read_bytes())
        data[entry.offset + entry.nbytes // 2] ^= 0x01
        Path(bad).write_bytes(bytes(data))
    group.comm.Barrier()
    return bad


@pytest.mark.parametrize("beside", [True, False], ids=["thread", "in-line"])
def test_a_restore_checksums_where_it_should_and_refuses_a_flipped_byte_either_way(
    group, tmp_path, monkeypatch, beside
):
    monkeypatch.setattr(restoring, "spare_core", lambda *_: beside)
    in_main_thread = []
    checksummed = restoring.records

    def recording(pieces, checksum):
        in_main_thread.append(threading.current_thread() is threading.main_thread())
        return checksummed(pieces, checksum)

    monkeypatch.setattr(restoring, "records", recording)
    want = (np.arange(1 << 18) % 11).astype(np.float32)  # 1 MiB: a window of its own
    with group.strategy.scope():
        v = mpistrat.Variable(want, name="v")
        small = mpistrat.Variable(np.arange(5.0), name="small")
    ckpt = mpistrat.Checkpoint(v=v, small=small)
    path = ckpt.write(os.path.join(shared_dir(group, tmp_path), "good"))
    with group.strategy.scope():
        v.assign(np.zeros_like(want))
    ckpt.read(path)
    restored = np.array_equal(v.numpy(), want)
    bad = flipped_in_data(group, path, "v")
    with group.strategy.scope():
        v.assign(np.full_like(want, -1.0))
    raises_on_every_rank(group.comm, InvalidArgumentError, lambda: ckpt.read(bad), "checksum mismatch in v")
    untouched = bool((v.numpy() == -1.0).all()) and small.numpy().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    where = in_main_thread and all(m is not beside for m in in_main_thread)
    all_ranks_agree(group.comm, restored and untouched and where, f"{restored} {untouched} {in_main_thread}")


@pytest.mark.parametrize("beside", [True, False], ids=["thread", "in-line"])
def test_an_error_while_one_rank_checksums_is_an_error_on_every_rank(group, tmp_path, monkeypatch, beside):
    monkeypatch.setattr(restoring, "spare_core", lambda *_: beside)
    checksummed = restoring.records

    def failing(pieces, checksum):
        if group.rank == group.size - 1:
            raise MemoryError("no memory left for the checksum")
        return checksummed(pieces, checksum)

    with group.strategy.scope():
        v = mpistrat.Variable(np.arange(1000.0), name="v")
    ckpt = mpistrat.Checkpoint(v=v)
    path = ckpt.write(os.path.join(shared_dir(group, tmp_path), "good"))
    monkeypatch.setattr(restoring, "records", failing)
    with group.strategy.scope():
        v.assign(np.zeros(1000))
    raises_on_every_rank(group.comm, InvalidArgumentError, lambda: ckpt.read(path), "no memory left")
    all_ranks_agree(group.comm, not v.numpy().any(), "assigned after a failed checksum")


@pytest.mark.parametrize("beside", [True, False], ids=["beside-writes", "after-writes"])
@pytest.mark.parametrize("shard", [False, True])
def test_a_save_checksums_where_it_should_and_the_files_checksums_are_the_references(
    group, tmp_path, monkeypatch, beside, shard
):
    """A thread checksums beside the writes where a rank has a core to spare, once they are written
    (while the flush waits for the disk) where not: the same file either way."""
    monkeypatch.setattr(saving.crc, "spare_core", lambda *_: beside)
    events = []
    checksummed, submit, write_rounds = saving.records, saving.crc.in_thread, saving.mpiio.write_rounds

    def recording(pieces):
        events.append("checksum" if threading.current_thread() is not threading.main_thread() else "in line")
        return checksummed(pieces)

    def submitting(fn, *args):
        events.append("thread")
        return submit(fn, *args)

    def writing(*args):
        events.append("writes")
        done = write_rounds(*args)
        events.append("written")
        return done

    monkeypatch.setattr(saving, "records", recording)
    monkeypatch.setattr(saving.crc, "in_thread", submitting)
    monkeypatch.setattr(saving.mpiio, "write_rounds", writing)
    ckpt, *_ = saved_state(group, shard)
    path = ckpt.write(os.path.join(shared_dir(group, tmp_path), "ckpt"))
    order = ["thread", "writes"] if beside else ["writes", "written", "thread"]
    problems = [] if [e for e in events if e in order] == order else [f"events {events}"]
    problems += [] if events.count("checksum") == 2 and "in line" not in events else [f"events {events}"]
    if group.rank == 0:
        got = load_file(path)
        with safe_open(path, framework="numpy") as f:
            checksums = json.loads(f.metadata()["crc32c"])
        problems += [k for k, v in got.items() if int(checksums[k], 16) != crc32c.crc32c(v.tobytes())]
    all_ranks_agree(group.comm, not problems, f"{problems}")


@pytest.mark.parametrize("beside", [True, False], ids=["beside-writes", "after-writes"])
def test_an_error_while_one_rank_checksums_a_save_is_an_error_on_every_rank(
    group, tmp_path, monkeypatch, beside
):
    monkeypatch.setattr(saving.crc, "spare_core", lambda *_: beside)
    checksummed = saving.records

    def failing(pieces):
        if group.rank == group.size - 1:
            raise MemoryError("no memory left for the checksum")
        return checksummed(pieces)

    with group.strategy.scope():
        v = mpistrat.Variable(np.arange(1000.0), name="v")
    ckpt = mpistrat.Checkpoint(v=v)
    directory = shared_dir(group, tmp_path)
    good = ckpt.write(os.path.join(directory, "ckpt"))
    before = Path(good).read_bytes()
    with group.strategy.scope():
        v.assign(np.zeros(1000))
    monkeypatch.setattr(saving, "records", failing)
    raises_on_every_rank(group.comm, OSError, lambda: ckpt.write(good), "no memory left")
    kept = Path(good).read_bytes() == before and sorted(os.listdir(directory)) == ["ckpt"]
    all_ranks_agree(
        group.comm, kept, f"the previous file changed, or a temporary is left: {os.listdir(directory)}"
    )


# -- the file is standard safetensors ------------------------------------------------------------


def saved_state(group, shard=False):
    """Variables of every dtype a variable may have, a sync-on-read sum, a 0-d and an empty array, Adam."""
    rng = np.random.default_rng(5)
    with group.strategy.scope():
        variables = {
            d: mpistrat.Variable((rng.standard_normal((3, 5)) * 50).astype(d), name=d)
            for d in DTYPES
            if d != "complex64"
        }
        variables["complex64"] = mpistrat.Variable((rng.standard_normal(4) + 1j).astype(np.complex64))
        variables["scalar"] = mpistrat.Variable(np.float32(2.5))
        variables["empty"] = mpistrat.Variable(np.zeros((0, 3), np.float32))
        seen = mpistrat.Variable(0.0, synchronization="ON_READ", aggregation="SUM")
        weights = [mpistrat.Variable(rng.standard_normal(n).astype(np.float32)) for n in (5, 1, 300)]
        opt = Adam(0.1, shard_state=shard)
    grads = [(np.ones(w.shape, np.float32) * (k + 1), w) for k, w in enumerate(weights)]
    group.strategy.run(lambda: opt.apply_gradients(grads))
    group.strategy.run(lambda: seen.assign_add(mpistrat.get_replica_context().replica_id_in_sync_group + 1.0))
    return mpistrat.Checkpoint(v=variables, seen=seen, w=weights, opt=opt), variables, seen, weights, opt


@pytest.mark.parametrize("shard", [False, True])
def test_a_checkpoint_is_a_safetensors_file_with_the_saved_values(group, tmp_path, shard):
    directory = shared_dir(group, tmp_path)
    ckpt, variables, seen, weights, opt = saved_state(group, shard)
    path = ckpt.save(os.path.join(directory, "ckpt"))
    with group.strategy.scope():
        want = {f"v/{k}": v.numpy() for k, v in variables.items()}
        want |= {f"w/{i}": w.numpy() for i, w in enumerate(weights)}
        want |= {
            f"opt/slots/w/{i}/{n}": opt.get_slot(w, n).numpy() for i, w in enumerate(weights) for n in "mv"
        }
        want |= {"seen": seen.numpy(), "opt/iterations": opt.iterations.numpy()}
        want |= {"opt/learning_rate": np.asarray(opt.learning_rate)}
    problems = []
    if group.rank == 0:
        got = load_file(path)
        if sorted(got) != sorted(want):
            problems.append(f"entries {sorted(got)} != {sorted(want)}")
        problems += [
            f"{k}: {got[k]!r} != {w!r}"
            for k, w in want.items()
            if k in got
            and (got[k].dtype != w.dtype or got[k].shape != w.shape or not np.array_equal(got[k], w))
        ]
        with safe_open(path, framework="numpy") as f:
            meta = f.metadata()
        if (
            meta["format"] != "mpistrat/2"
            or int(meta["num_replicas"]) != group.size
            or meta["save_counter"] != "1"
        ):
            problems.append(f"metadata {meta}")
        checksums = json.loads(meta["crc32c"])
        problems += [
            f"crc of {k}" for k, v in got.items() if int(checksums[k], 16) != crc32c.crc32c(v.tobytes())
        ]
    all_ranks_agree(group.comm, not problems, "; ".join(problems[:5]))


def test_a_file_saved_by_safetensors_is_refused_as_foreign(group, tmp_path):
    directory = shared_dir(group, tmp_path)
    path = os.path.join(directory, "foreign.safetensors")
    if group.rank == 0:
        save_file({"v": np.zeros(3)}, path)
    group.comm.Barrier()
    with group.strategy.scope():
        ckpt = mpistrat.Checkpoint(v=mpistrat.Variable(np.ones(3)))
    raises_on_every_rank(
        group.comm, InvalidArgumentError, lambda: ckpt.restore(path), "not an mpistrat checkpoint"
    )


def test_a_dtype_safetensors_cannot_hold_is_an_error_on_every_rank_before_any_file(group, tmp_path):
    directory = shared_dir(group, tmp_path)
    with group.strategy.scope():
        ok = mpistrat.Variable(np.ones(2, np.float32))
        wide = mpistrat.Variable(np.ones(2, np.longdouble), name="wide")
    message = raises_on_every_rank(
        group.comm,
        InvalidArgumentError,
        lambda: mpistrat.Checkpoint(ok=ok, wide=wide).save(os.path.join(directory, "c")),
        f"wide is {np.dtype(np.longdouble)}",
    )
    assert "safetensors" in message
    all_ranks_agree(group.comm, os.listdir(directory) == [], str(os.listdir(directory)))


@pytest.mark.parametrize("shard", [False, True])
def test_a_complex128_model_trained_by_adam_is_saved_as_float64_pairs_and_restored(group, tmp_path, shard):
    """safetensors has no complex128: such entries are F64 with a last dimension of 2 (NumPy's layout of
    the real and imaginary parts), named in the metadata's ``dtypes``; they restore as complex128, in
    either sharding."""
    directory = shared_dir(group, tmp_path)
    rng = np.random.default_rng(3)
    start = rng.standard_normal((3, 5)) + 1j * rng.standard_normal((3, 5))
    with group.strategy.scope():
        w = mpistrat.Variable(start, name="w")
        b = mpistrat.Variable(np.complex64(1 - 1j), name="b")
        opt = Adam(0.1, shard_state=shard)
    grads = [(np.full((3, 5), 0.5 - 2j), w), (np.complex64(0.25j), b)]
    group.strategy.run(lambda: opt.apply_gradients(grads))
    ckpt = mpistrat.Checkpoint(model={"w": w, "b": b}, opt=opt)
    path = ckpt.save(os.path.join(directory, "ckpt"))
    with group.strategy.scope():
        saved = {"model/w": w.numpy(), "model/b": b.numpy()}
        saved |= {f"opt/slots/model/w/{n}": opt.get_slot(w, n).numpy() for n in opt.slot_names}
    problems = []
    if group.rank == 0:
        got = load_file(path)
        for name, value in saved.items():
            pairs = value.dtype == np.complex128  # stored as pairs of float64: real, imaginary
            want = np.stack([value.real, value.imag], axis=-1) if pairs else value
            if got[name].dtype != want.dtype or not np.array_equal(got[name], want):
                problems.append(f"{name}: {got[name]!r} != {want!r}")
        with safe_open(path, framework="numpy") as f:
            dtypes = json.loads(f.metadata()["dtypes"])
        if dtypes != {
            "model/w": "complex128",
            "opt/slots/model/w/m": "complex128",
            "opt/slots/model/w/v": "complex128",
        }:
            problems.append(f"dtypes {dtypes}")
    all_ranks_agree(group.comm, not problems, "; ".join(problems))
    with group.strategy.scope():
        w2 = mpistrat.Variable(np.zeros((3, 5), np.complex128), name="w")
        b2 = mpistrat.Variable(np.complex64(0), name="b")
        opt2 = Adam(0.1, shard_state=not shard)
    restored = mpistrat.Checkpoint(model={"w": w2, "b": b2}, opt=opt2)
    restored.restore(path).assert_consumed()
    with group.strategy.scope():
        again = {"model/w": w2.numpy(), "model/b": b2.numpy()}
        again |= {f"opt/slots/model/w/{n}": opt2.get_slot(w2, n).numpy() for n in opt2.slot_names}
    same = all(again[k].dtype == v.dtype and np.array_equal(again[k], v) for k, v in saved.items())
    all_ranks_agree(group.comm, same, f"{again} != {saved}")


# -- headers checked before anything is read -----------------------------------------------------


def header_of(path):
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


SEAL = b'{"__metadata__":{"header_crc32":"'  # how the header begins; its own CRC-32 follows


def sealed(head):
    """``head`` (the length and the JSON) with its checksum as the format describes it: the CRC-32 of
    those bytes with the 8 hex digits after ``SEAL`` left out, written there."""
    at = 8 + len(SEAL)
    assert head[8:at] == SEAL, head[:at]
    return head[:at] + b"%08x" % zlib.crc32(head[:at] + head[at + 8 :]) + head[at + 8 :]


def with_header(header, data):
    """A file of ``header`` and ``data``; sealed as a save seals it, unless the header has no seal."""
    if "header_crc32" not in header["__metadata__"]:
        text = json.dumps(header).encode()
        return struct.pack("<Q", len(text)) + text + data
    meta = {"header_crc32": "00000000", **header["__metadata__"]}
    text = json.dumps({**header, "__metadata__": meta}, separators=(",", ":")).encode()
    return sealed(struct.pack("<Q", len(text)) + text) + data


def damaged_headers(path):
    """(name, bytes, what the error must say) of files whose header is wrong in one way each."""
    header, data = header_of(path)
    name = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    begin, end = header[name]["data_offsets"]

    def changed(edit):
        h = json.loads(json.dumps(header))
        edit(h)
        return with_header(h, data)

    yield "overlap", changed(lambda h: h[name].update(data_offsets=[begin - 4, end - 4])), "overlaps"
    yield (
        "out of range",
        changed(lambda h: h[name].update(data_offsets=[len(data), len(data) + end - begin])),
        "",
    )
    yield "gap", with_header(header, data[:begin] + bytes(8) + data[begin:]), ""
    yield "wrong size", changed(lambda h: h[name].update(shape=[*h[name]["shape"], 2])), "spans"
    yield "bad dtype", changed(lambda h: h[name].update(dtype="Q99")), "Q99"
    yield "negative", changed(lambda h: h[name].update(data_offsets=[-8, end - begin - 8])), ">= 0"
    yield "no checksum", changed(lambda h: h["__metadata__"].update(crc32c="{}")), "metadata"
    yield "not json", struct.pack("<Q", 20) + b"{not json at all....." + data, "not JSON"
    deep = b"[" * 100_000 + b"]" * 100_000  # valid JSON, deeper than Python's parser follows
    yield "nested deep", struct.pack("<Q", len(deep)) + deep + data, "not JSON"
    deep_positions = changed(lambda h: h["__metadata__"].update(positions=deep.decode()))
    yield "positions nested deep", deep_positions, "metadata"
    yield "huge length", struct.pack("<Q", 1 << 40) + data, "header of"
    yield "truncated", with_header(header, data[:-3]), "truncated"
    yield "extra bytes", with_header(header, data + b"xx"), "extra bytes"
    yield "empty", b"", "shorter than"


def test_damaged_headers_are_one_clear_error_on_every_rank_and_nothing_is_assigned(group, tmp_path):
    directory = shared_dir(group, tmp_path)
    ckpt, _, _, weights, opt = saved_state(group, shard=True)
    path = ckpt.write(os.path.join(directory, "good"))
    cases = []
    if group.rank == 0:
        for name, content, says in damaged_headers(path):
            target = os.path.join(directory, name.replace(" ", "-"))
            Path(target).write_bytes(content)
            cases.append((target, says))
    cases = group.comm.bcast(cases, root=0)
    with group.strategy.scope():
        before = [w.numpy() for w in weights] + [int(opt.iterations.numpy())]
    for target, says in cases:
        with group.strategy.scope():
            for w in weights:
                w.assign(np.zeros(w.shape, np.float32))
        raises_on_every_rank(group.comm, InvalidArgumentError, lambda t=target: ckpt.restore(t), says)
        with group.strategy.scope():
            untouched = all(not w.numpy().any() for w in weights)
        all_ranks_agree(group.comm, untouched, f"{target}: assigned before the error")
    with group.strategy.scope():
        ckpt.restore(path).assert_consumed()
        after = [w.numpy() for w in weights] + [int(opt.iterations.numpy())]
    all_ranks_agree(group.comm, all(np.array_equal(a, b) for a, b in zip(before, after, strict=True)))


def test_header_numbers_beyond_int64_are_an_error_naming_the_file_and_nothing_is_assigned(group, tmp_path):
    directory = shared_dir(group, tmp_path)
    with group.strategy.scope():
        w = mpistrat.Variable(np.arange(4.0), name="w")
    data = mpistrat.ArrayDataset(np.arange(64.0).reshape(32, 2), 8)
    iterator = iter(group.strategy.experimental_distribute_dataset(data))
    next(iterator)
    ckpt = mpistrat.Checkpoint(w=w, data=iterator)
    path = ckpt.write(os.path.join(directory, "good"))
    cases = []
    if group.rank == 0:
        header, data_bytes = header_of(path)
        positions = json.loads(header["__metadata__"]["positions"])
        for name, key, value in [
            ("counter", "save_counter", str(2**63)),
            ("counter20", "save_counter", "9" * 20),
            ("ranks", "num_replicas", str(2**64)),
            ("position", "positions", json.dumps({"data": [10**20, *positions["data"][1:]]})),
            ("fraction", "positions", json.dumps({"data": [0.5, *positions["data"][1:]]})),
        ]:
            edited = json.loads(json.dumps(header))
            edited["__metadata__"][key] = value
            Path(directory, name).write_bytes(with_header(edited, data_bytes))
            cases.append((os.path.join(directory, name), "outside [" if key != "positions" else "int64"))
    cases = group.comm.bcast(cases, root=0)
    with group.strategy.scope():
        ckpt.save_counter.assign(np.int64(5))
    for target, says in cases:
        refused_with_nothing_assigned(group, ckpt, w, target, says)
    # The dataset stayed where it was: its second global batch comes next (rows 8-15).
    first = first_row_of_the_next_batch(group, iterator)
    all_ranks_agree(group.comm, first == [16.0, 17.0], f"the dataset moved: {first}")


def refused_with_nothing_assigned(group, ckpt, w, target, says):
    """``ckpt.restore(target)`` is an error naming it on every rank, and neither ``w`` (zeroed first)
    nor the save counter was assigned."""
    counter = int(ckpt.save_counter.numpy())
    with group.strategy.scope():
        w.assign(np.zeros(w.shape))
    message = raises_on_every_rank(group.comm, InvalidArgumentError, lambda: ckpt.restore(target), says)
    with group.strategy.scope():
        untouched = not w.numpy().any() and int(ckpt.save_counter.numpy()) == counter and target in message
    all_ranks_agree(group.comm, untouched, f"{target}: assigned before the error")


def first_row_of_the_next_batch(group, iterator):
    return np.concatenate([np.asarray(x) for x in group.comm.allgather(np.asarray(next(iterator)))])[
        0
    ].tolist()


@pytest.mark.serial("one process reads the files")
def test_every_flipped_bit_of_the_header_and_its_metadata_is_found(tmp_path):
    """Any one bit changed in the length or the JSON header makes the file unreadable as a checkpoint."""
    w = mpistrat.Variable(np.arange(3.0), name="w")
    data = mpistrat.ArrayDataset(np.arange(16.0).reshape(8, 2), 4)
    iterator = iter(mpistrat.get_strategy().experimental_distribute_dataset(data))
    next(iterator)
    good = Path(mpistrat.Checkpoint(model={"w": w}, data=iterator).save(tmp_path / "ckpt"))
    content = good.read_bytes()
    (length,) = struct.unpack("<Q", content[:8])
    damaged = tmp_path / "damaged"
    unnoticed = []
    for at in range(8 + length):
        for bit in range(8):
            flipped = bytearray(content)
            flipped[at] ^= 1 << bit
            damaged.write_bytes(flipped)
            try:
                noticed = read_table(str(damaged)) is None  # None: not an mpistrat checkpoint
            except InvalidArgumentError:
                noticed = True
            if not noticed:
                unnoticed.append((at, bit, bytes(content[max(at - 8, 0) : at + 8])))
    assert not unnoticed, unnoticed[:10]


def test_a_changed_position_or_counter_in_the_header_is_an_error_and_nothing_is_assigned(group, tmp_path):
    directory = shared_dir(group, tmp_path)
    with group.strategy.scope():
        w = mpistrat.Variable(np.arange(4.0), name="w")
    data = mpistrat.ArrayDataset(np.arange(96.0).reshape(48, 2), 8)
    iterator = iter(group.strategy.experimental_distribute_dataset(data))
    for _ in range(4):
        next(iterator)
    ckpt = mpistrat.Checkpoint(w=w, data=iterator)
    path = ckpt.save(os.path.join(directory, "ckpt"))
    cases = []
    if group.rank == 0:
        content = Path(path).read_bytes()
        positions = json.loads(header_of(path)[0]["__metadata__"]["positions"])
        examples = str(positions["data"][-1]).encode()  # the examples taken: 32
        for name, old, new in [
            ("position", b'"positions":"{\\"data\\": [' + str(positions["data"][0]).encode(), None),
            ("examples", b", " + examples + b"]", b", " + examples.replace(b"3", b"4") + b"]"),
            ("counter", b'"save_counter":"1"', b'"save_counter":"7"'),
        ]:
            assert content.count(old) == 1, (old, content[:400])
            new = new or old[:-1] + bytes([old[-1] ^ 1])  # the digest's last digit, one bit flipped
            Path(directory, name).write_bytes(content.replace(old, new))
            cases.append(os.path.join(directory, name))
    cases = group.comm.bcast(cases, root=0)
    for target in cases:
        refused_with_nothing_assigned(group, ckpt, w, target, "checksum")
    first = first_row_of_the_next_batch(group, iterator)
    all_ranks_agree(group.comm, first == [64.0, 65.0], f"the dataset moved: {first}")


@pytest.mark.serial("one process reads the files")
def test_an_earlier_versions_header_with_a_changed_key_is_not_taken_for_an_old_file(tmp_path):
    """A file without the header's checksum is read (data/format2), but only with the metadata those
    versions wrote: a flipped bit in a key (or in ``header_crc32``'s name) is not an older file."""
    old = (FORMAT2 / "ckpt-1").read_bytes()
    assert read_table(str(FORMAT2 / "ckpt-1")).counter == 1
    w = mpistrat.Variable(np.arange(3.0), name="w")
    new = Path(mpistrat.Checkpoint(w=w).write(tmp_path / "new")).read_bytes()
    for content, key in [(old, b'"save_counter"'), (new, b'"header_crc32"')]:
        changed = key[:1] + bytes([key[1] ^ 0x20]) + key[2:]  # its first letter's case
        (tmp_path / "changed").write_bytes(content.replace(key, changed, 1))
        with pytest.raises(InvalidArgumentError, match="unknown metadata"):
            read_table(str(tmp_path / "changed"))


# -- format 1 ----------------------------------------------------------------------------------


@pytest.mark.parametrize("shard", [False, True])
def test_a_format_1_checkpoint_of_the_previous_version_restores_at_any_rank_count(group, shard):
    """ckpt-1 was written at 2 ranks by the previous version (data/format1/make_format1.py)."""
    want = json.loads((FORMAT1 / "ckpt-1.json").read_text())
    with group.strategy.scope():
        w = mpistrat.Variable(np.zeros((3, 4), np.float32), name="w")
        b = mpistrat.Variable(np.zeros(5), name="b")
        step = mpistrat.Variable(np.int64(0), name="step")
        seen = mpistrat.Variable(0.0, synchronization="ON_READ", aggregation="SUM", name="seen")
        opt = Adam(0.01, shard_state=shard)
    data = mpistrat.ArrayDataset(np.arange(64, dtype=np.float32).reshape(32, 2), 8)
    iterator = iter(group.strategy.experimental_distribute_dataset(data))
    ckpt = mpistrat.Checkpoint(model={"w": w, "b": b}, step=step, seen=seen, opt=opt, data=iterator)
    status = ckpt.restore(str(FORMAT1 / "ckpt-1"))
    with pytest.raises(AssertionError, match=r"\(they keep their values\): opt/learning_rate$"):
        status.assert_consumed()  # saved before the learning rate was: the only entry it lacks
    with group.strategy.scope():
        slots = {f"{v.name}/{n}": opt.get_slot(v, n).numpy() for v in (w, b) for n in opt.slot_names}
        got = [w.numpy(), b.numpy(), int(step.numpy()), float(seen.numpy()), int(opt.iterations.numpy())]
    checks = RankChecks()
    checks.that(
        np.array_equal(got[0], np.float32(want["model/w"])) and np.array_equal(got[1], want["model/b"])
    )
    checks.that(
        got[2:] == [want["step"], want["seen"], want["opt/iterations"]] and int(ckpt.save_counter) == 1
    )
    checks.that(all(np.array_equal(v, np.asarray(want["slots"][k], v.dtype)) for k, v in slots.items()))
    batch = next(iterator)  # two of the four global batches were taken when it was saved
    first = np.concatenate([np.asarray(x) for x in group.comm.allgather(np.asarray(batch))])
    checks.that(first[0].tolist() == [32.0, 33.0])
    checks.agree(group.comm, f"{got} {first[:1]}")


def earlier_state(group, shard):
    """The variables, optimizer and dataset data/format2*/make_format2.py saved, zeroed."""
    with group.strategy.scope():
        w = mpistrat.Variable(np.zeros((3, 4), np.float32), name="w")
        b = mpistrat.Variable(np.zeros(5), name="b")
        head = mpistrat.Variable(np.zeros(2, np.float32), name="head")
        step = mpistrat.Variable(np.int64(0), name="step")
        seen = mpistrat.Variable(0.0, synchronization="ON_READ", aggregation="SUM", name="seen")
        opt = Adam(0.01, shard_state=shard)
    data = mpistrat.ArrayDataset(np.arange(64, dtype=np.float32).reshape(32, 2), 8)
    iterator = iter(group.strategy.experimental_distribute_dataset(data))
    model = {"w": w, "b": b, "head.b": head}
    ckpt = mpistrat.Checkpoint(model=model, step=step, seen=seen, opt=opt, data=iterator)
    return ckpt, model, step, seen, opt, iterator


@pytest.mark.parametrize("shard", [False, True])
@pytest.mark.parametrize("folder", [FORMAT2, FORMAT2_CRC32], ids=["unsealed", "crc32"])
def test_a_format_2_checkpoint_of_an_earlier_version_restores_at_any_rank_count(group, shard, folder):
    """Each ckpt-1 was written at 2 ranks by an earlier version, its entries' checksums CRC-32
    (data/*/make_format2.py). data/format2's header has no checksum of its own, and its dict key
    holding a dot is not escaped (``model/head.b``); data/format2-crc32's header has its CRC-32."""
    want = json.loads((folder / "ckpt-1.json").read_text())
    ckpt, model, step, seen, opt, iterator = earlier_state(group, shard)
    status = ckpt.restore(str(folder / "ckpt-1"))
    with pytest.raises(AssertionError, match=r"\(they keep their values\): opt/learning_rate$"):
        status.assert_consumed()  # saved before the learning rate was: the only entry it lacks
    with group.strategy.scope():
        slots = {f"{v.name}/{n}": opt.get_slot(v, n).numpy() for v in model.values() for n in opt.slot_names}
        got = [int(step.numpy()), float(seen.numpy()), int(opt.iterations.numpy()), int(ckpt.save_counter)]
        values = {f"model/{k}": v.numpy() for k, v in model.items()}
    checks = RankChecks()
    checks.that(all(np.array_equal(v, np.asarray(want[k], v.dtype)) for k, v in values.items()))
    checks.that(got == [want["step"], want["seen"], want["opt/iterations"], 1])
    checks.that(all(np.array_equal(v, np.asarray(want["slots"][k], v.dtype)) for k, v in slots.items()))
    batch = next(iterator)  # two of the four global batches were taken when it was saved
    first = np.concatenate([np.asarray(x) for x in group.comm.allgather(np.asarray(batch))])
    checks.that(first[0].tolist() == [32.0, 33.0])
    checks.agree(group.comm, f"{got} {values} {first[:1]}")


@pytest.mark.parametrize("folder", [FORMAT2, FORMAT2_CRC32], ids=["unsealed", "crc32"])
def test_a_flipped_byte_in_an_earlier_versions_data_fails_its_crc32(group, tmp_path, folder):
    directory = shared_dir(group, tmp_path)
    target = os.path.join(directory, "flipped")
    if group.rank == 0:
        content = bytearray((folder / "ckpt-1").read_bytes())
        content[-3] ^= 0x10  # inside the last entry
        Path(target).write_bytes(bytes(content))
    group.comm.Barrier()
    ckpt, model, *_ = earlier_state(group, shard=False)
    raises_on_every_rank(group.comm, InvalidArgumentError, lambda: ckpt.restore(target), "checksum mismatch")
    with group.strategy.scope():
        untouched = not any(v.numpy().any() for v in model.values())
    all_ranks_agree(group.comm, untouched, "assigned before the error")


def format_1_file(path, arrays):
    """A format-1 file as the previous version wrote it: .npy members in a stored zip, then its marks."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, value in [*arrays.items(), ("save_counter", np.array(3, np.int64))]:
            with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, value, allow_pickle=False)
        with archive.open("__mpistrat__.npy", "w", force_zip64=True) as member:
            np.lib.format.write_array(member, np.array(json.dumps({"format": 1, "num_replicas": 2})))


def test_format_1_members_in_fortran_order_and_damaged_members(group, tmp_path):
    checks = RankChecks()
    directory = shared_dir(group, tmp_path)
    value = np.asfortranarray(np.arange(12.0).reshape(3, 4))
    good, short = os.path.join(directory, "good"), os.path.join(directory, "short")
    if group.rank == 0:
        format_1_file(good, {"a": value, "b": np.arange(5, dtype=np.int32)})
        # A member re-zipped a few bytes short: its CRC matches its bytes, not its .npy header.
        with zipfile.ZipFile(good) as archive:
            members = {i.filename: archive.read(i) for i in archive.infolist()}
        members["b.npy"] = members["b.npy"][:-4]
        with zipfile.ZipFile(short, "w", zipfile.ZIP_STORED) as archive:
            for name, content in members.items():
                archive.writestr(name, content)
    group.comm.Barrier()
    with group.strategy.scope():
        a, b = mpistrat.Variable(np.zeros((3, 4))), mpistrat.Variable(np.zeros(5, np.int32))
    ckpt = mpistrat.Checkpoint(a=a, b=b)
    ckpt.restore(good).assert_consumed()
    with group.strategy.scope():
        checks.that(np.array_equal(a.numpy(), value) and b.numpy().tolist() == [0, 1, 2, 3, 4])
        checks.that(int(ckpt.save_counter) == 3)
        a.assign(np.zeros((3, 4)))
    checks.agree(group.comm, repr(a))
    raises_on_every_rank(group.comm, InvalidArgumentError, lambda: ckpt.restore(short), "header says")
    with group.strategy.scope():
        all_ranks_agree(group.comm, not a.numpy().any(), "assigned before the error")


def test_format_1_slots_in_fortran_order_restore_into_the_parts_of_sharded_slots(group, tmp_path):
    """A member in Fortran order is gathered whole; each rank keeps its parts of a sharded slot."""
    directory = shared_dir(group, tmp_path)
    path = os.path.join(directory, "slots")
    value = np.arange(12.0).reshape(3, 4)
    slots = {"m": value + 100.0, "v": value * value}
    if group.rank == 0:
        members = {f"opt/slots/w/{n}": np.asfortranarray(v) for n, v in slots.items()}
        format_1_file(path, {"w": np.asfortranarray(value), **members})
    group.comm.Barrier()
    with group.strategy.scope():
        w = mpistrat.Variable(np.zeros((3, 4)), name="w")
        opt = Adam(0.01, shard_state=True)
    mpistrat.Checkpoint(w=w, opt=opt).restore(path)
    with group.strategy.scope():
        got = {n: opt.get_slot(w, n).numpy() for n in slots}
        checks = RankChecks()
        checks.that(np.array_equal(w.numpy(), value))
    checks.that(all(np.array_equal(got[n], v) for n, v in slots.items()))
    checks.agree(group.comm, repr(got))


def test_read_table_names_the_file_and_what_is_wrong(tmp_path):
    """One rank reads the table: a missing file is FileNotFoundError, a foreign one None."""
    with pytest.raises(FileNotFoundError):
        read_table(str(tmp_path / "nothing"))
    np.savez(tmp_path / "foreign.npz", v=np.zeros(2))
    assert read_table(str(tmp_path / "foreign.npz")) is None
    (tmp_path / "text").write_text("hello, world: not a checkpoint")
    with pytest.raises(InvalidArgumentError, match=str(tmp_path / "text")):
        read_table(str(tmp_path / "text"))
    with pytest.raises(InvalidArgumentError, match="is a directory, not a regular file"):
        read_table(str(tmp_path))
    # Format 1 whose marks nest too deep.
    with zipfile.ZipFile(tmp_path / "deep", "w") as archive, archive.open("__mpistrat__.npy", "w") as member:
        np.lib.format.write_array(member, np.array("[" * 100_000 + "]" * 100_000))
    with pytest.raises(InvalidArgumentError, match="RecursionError"):
        read_table(str(tmp_path / "deep"))

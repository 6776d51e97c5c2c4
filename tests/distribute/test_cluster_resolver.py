"""mpistrat.cluster_resolver against what TensorFlow 2.21's resolvers return for the same input.

Every expected value here was printed by ``tensorflow-cpu`` 2.21 (its ``ClusterSpec``,
``SimpleClusterResolver``, ``TFConfigClusterResolver``, ``SlurmClusterResolver`` and the
Slurm module's ``expand_hostlist``/``expand_tasks_per_node``) for the same arguments and
environment, except where a comment says the reference is ``scontrol show hostnames`` (Slurm
23's own parser: tf's cannot expand several bracket groups in one name). Node lists and
tasks-per-node strings are the forms Slurm's documentation shows (``tux[1-3]``,
``lx[10-20]``, ``lx[15-18,32]``, ``rack[0-1]_blade[0-2]``, ``2(x3),1``).
"""

import json
import os
import shutil
import subprocess

import pytest
from mpi4py import MPI

import mpistrat
from mpistrat import InvalidArgumentError
from mpistrat.cluster_resolver import (
    ClusterSpec,
    SimpleClusterResolver,
    SlurmClusterResolver,
    TFConfigClusterResolver,
    expand_hostlist,
    expand_tasks_per_node,
)
from tests.conftest import RankChecks, all_ranks_agree, raises_on_every_rank

HOSTLISTS = {  # tf's expand_hostlist (and scontrol show hostnames) on each
    "tux[1-3]": ["tux1", "tux2", "tux3"],
    "lx[10-20]": [f"lx{i}" for i in range(10, 21)],
    "lx[15-18,32]": ["lx15", "lx16", "lx17", "lx18", "lx32"],
    "node[01-04,07]": ["node01", "node02", "node03", "node04", "node07"],
    "n[1-2],m5,o[3-4,6,7-9]": ["n1", "n2", "m5", "o3", "o4", "o6", "o7", "o8", "o9"],
    "lx[008-011]": ["lx008", "lx009", "lx010", "lx011"],
    "tux[2,1-2]": ["tux2", "tux1", "tux2"],  # order kept, duplicates kept
    "host": ["host"],
    "a[9-11],b": ["a9", "a10", "a11", "b"],
}
# scontrol show hostnames (tf's parser refuses these): several bracket groups, the last fastest
MULTI_BRACKET = {
    "rack[1-2]-n[3-4]": ["rack1-n3", "rack1-n4", "rack2-n3", "rack2-n4"],
    "rack[0-1]_blade[0-2]": [f"rack{r}_blade{b}" for r in range(2) for b in range(3)],
}
TASKS = {"2(x3),1": [2, 2, 2, 1], "3(x2),2,1": [3, 3, 2, 1], "1": [1], "4(x1)": [4], "16(x128)": [16] * 128}


@pytest.mark.parametrize("hostlist", sorted(HOSTLISTS))
def test_expand_hostlist_gives_tfs_lists(hostlist):
    assert expand_hostlist(hostlist) == HOSTLISTS[hostlist]


@pytest.mark.parametrize("hostlist", sorted(MULTI_BRACKET))
def test_several_bracket_groups_expand_as_scontrol_does(hostlist):
    assert expand_hostlist(hostlist) == MULTI_BRACKET[hostlist]


@pytest.mark.parametrize("bad", ["x[1-3", "x]1", "x[a-b]", "x[3-1]", "a,,b", "x[[1]]"])
def test_malformed_hostlists_are_value_errors(bad):
    # tf: ValueError for the first three; the others are malformed too (scontrol: "Invalid hostlist")
    with pytest.raises(ValueError, match="Invalid hostlist"):
        expand_hostlist(bad)


@pytest.mark.parametrize("spec", sorted(TASKS))
def test_expand_tasks_per_node_gives_tfs_lists(spec):
    assert expand_tasks_per_node(spec) == TASKS[spec]


@pytest.mark.parametrize("bad", ["2(x)", "a", ""])
def test_malformed_tasks_per_node_are_value_errors(bad):
    with pytest.raises(ValueError, match="tasks-per-node"):
        expand_tasks_per_node(bad)


@pytest.mark.timeout(60)
def test_the_parser_agrees_with_scontrol_where_slurm_is_configured():
    # Under `make test-slurm` (SLURM_CONF set to a working configuration) Slurm's own parser is
    # the reference; elsewhere scontrol cannot start without a configuration, and this skips.
    scontrol = shutil.which("scontrol")
    if scontrol is None or not os.environ.get("SLURM_CONF"):
        pytest.skip("no configured Slurm (scontrol and SLURM_CONF)")
    for hostlist in [*HOSTLISTS, *MULTI_BRACKET]:
        done = subprocess.run(
            [scontrol, "show", "hostnames", hostlist], capture_output=True, text=True, timeout=30
        )
        if done.returncode != 0:
            pytest.skip(f"scontrol show hostnames failed: {done.stderr.strip()}")
        assert expand_hostlist(hostlist) == done.stdout.split(), hostlist


# -- ClusterSpec ---------------------------------------------------------------------------------


def test_cluster_spec_methods_give_tfs_values():
    spec = ClusterSpec({"worker": ["a:1", "b:2"], "ps": {1: "c:3"}})
    assert spec.as_dict() == {"worker": ["a:1", "b:2"], "ps": {1: "c:3"}}
    assert spec.jobs == ["worker", "ps"]
    assert spec.num_tasks("worker") == 2
    assert spec.task_indices("ps") == [1]
    assert spec.task_address("ps", 1) == "c:3"
    assert spec.job_tasks("ps") == [None, "c:3"]
    assert spec.job_tasks("worker") == ["a:1", "b:2"]
    assert repr(spec) == str(spec) == "ClusterSpec({'ps': {1: 'c:3'}, 'worker': ['a:1', 'b:2']})"
    assert spec == ClusterSpec({"worker": ["a:1", "b:2"], "ps": {1: "c:3"}})
    assert list(ClusterSpec(spec).as_dict()) == ["ps", "worker"]  # tf's copy sorts the jobs
    assert not ClusterSpec({}) and ClusterSpec({}).as_dict() == {}
    assert ClusterSpec({"worker": {0: "a:1", 2: "b:1"}}).as_dict() == {"worker": {0: "a:1", 2: "b:1"}}
    with pytest.raises(ValueError, match="No task with index 5 in job 'worker'"):
        spec.task_address("worker", 5)
    with pytest.raises(ValueError, match="No such job in cluster: 'chief'"):
        spec.num_tasks("chief")
    with pytest.raises(TypeError, match="must be a dictionary"):
        ClusterSpec(5)  # type: ignore[arg-type]


def test_simple_cluster_resolver_gives_tfs_values():
    spec = ClusterSpec({"worker": ["a:1", "b:2"], "ps": {1: "c:3"}})
    r = SimpleClusterResolver(
        spec, task_type="worker", task_id=1, num_accelerators={"GPU": 2}, rpc_layer="grpc"
    )
    got = (r.task_type, r.task_id, r.cluster_spec().as_dict(), r.master(), r.num_accelerators(), r.rpc_layer)
    assert got == ("worker", 1, spec.as_dict(), "grpc://", {"GPU": 2}, "grpc")
    assert r.environment == ""
    assert r.master("ps", 1) == "grpc://c:3"
    bare = SimpleClusterResolver(spec)
    assert (bare.task_type, bare.task_id, bare.master(), bare.num_accelerators(), bare.rpc_layer) == (
        None, None, "", {}, None,
    )  # fmt: skip
    r.task_type, r.task_id = "ps", 0
    assert (r.task_type, r.task_id) == ("ps", 0)
    with pytest.raises(TypeError, match="cluster_spec must be"):
        SimpleClusterResolver({"worker": ["a:1"]})  # type: ignore[arg-type]


@pytest.mark.serial("environment-only")
def test_tf_config_cluster_resolver_gives_tfs_values(monkeypatch):
    config = {
        "cluster": {"worker": ["host1:2222", "host2:2222"], "chief": ["host0:2222"]},
        "task": {"type": "worker", "index": 1},
        "rpc_layer": "grpc",
        "environment": "google",
    }
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    r = TFConfigClusterResolver()
    assert (r.task_type, r.task_id, r.cluster_spec().as_dict(), r.master(), r.rpc_layer, r.environment) == (
        "worker", 1, config["cluster"], "grpc://host2:2222", "grpc", None,
    )  # fmt: skip
    assert r.master("chief", 0) == "grpc://host0:2222"
    over = TFConfigClusterResolver(task_type="chief", task_id=0, rpc_layer="foo")
    assert (over.task_type, over.task_id, over.master(), over.rpc_layer) == (
        "chief",
        0,
        "foo://host0:2222",
        "foo",
    )
    monkeypatch.setenv(
        "TF_CONFIG", json.dumps({"cluster": {"worker": ["host1:2222"]}, "task": {"type": "worker"}})
    )
    assert (r.master(), r.rpc_layer, r.environment) == ("", None, None)
    monkeypatch.delenv("TF_CONFIG")
    assert (r.task_type, r.task_id, r.cluster_spec().as_dict(), r.master(), r.rpc_layer) == (
        None,
        None,
        {},
        "",
        None,
    )
    monkeypatch.setenv("TF_CONFIG", "not json")
    with pytest.raises(ValueError):  # tf: json.JSONDecodeError, a ValueError
        r.cluster_spec()


# -- SlurmClusterResolver --------------------------------------------------------------------------

STEP = {  # a step of 7 tasks on three nodes, 6 GPUs visible per node
    "SLURM_PROCID": "3",
    "SLURM_STEP_NUM_TASKS": "7",
    "SLURM_STEP_NODELIST": "node[01-03]",
    "SLURM_STEP_TASKS_PER_NODE": "3,2(x2)",
    "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5",
}


@pytest.fixture
def slurm_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith("SLURM_"):
            monkeypatch.delenv(key)
    for key, value in STEP.items():
        monkeypatch.setenv(key, value)
    return monkeypatch


@pytest.mark.serial("environment-only")
def test_slurm_resolver_gives_tfs_cluster(slurm_env):
    r = SlurmClusterResolver()
    assert (r.task_type, r.task_id, r.get_task_info()) == (
        None,
        None,
        (None, None),
    )  # as tf: set by cluster_spec()
    spec = r.cluster_spec().as_dict()
    node01 = ["node01:8888", "node01:8889", "node01:8890"]
    assert spec == {"worker": [*node01, "node02:8888", "node02:8889", "node03:8888", "node03:8889"]}
    assert (r.task_type, r.task_id, r.num_accelerators(), r.rpc_layer) == ("worker", 3, {"GPU": 2}, "grpc")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"  # task 3 is node02's first: its GPUs 0 and 1
    assert r.master() == "grpc://node02:8888"


@pytest.mark.serial("environment-only")
def test_slurm_resolver_with_jobs_ports_and_tasks_per_node_gives_tfs_cluster(slurm_env):
    r = SlurmClusterResolver(jobs={"ps": 1, "worker": 6}, port_base=9000, gpus_per_node=6, auto_set_gpu=False)
    assert r.cluster_spec().as_dict() == {
        "ps": ["node01:9000"],
        "worker": ["node01:9001", "node01:9002", "node02:9000", "node02:9001", "node03:9000", "node03:9001"],
    }
    assert (r.task_type, r.task_id, r.num_accelerators()) == ("worker", 2, {"GPU": 2})
    assert (r.master(), r.master("ps", 0, "http")) == ("grpc://node02:9000", "http://node01:9000")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == STEP["CUDA_VISIBLE_DEVICES"]  # auto_set_gpu=False

    r = SlurmClusterResolver(tasks_per_node=2, jobs={"worker": 6}, gpus_per_node=2, gpus_per_task=1)
    assert r.cluster_spec().as_dict() == {
        "worker": ["node01:8888", "node01:8889", "node02:8888", "node02:8889", "node03:8888", "node03:8889"]
    }
    assert (r.task_type, r.task_id, os.environ["CUDA_VISIBLE_DEVICES"]) == ("worker", 3, "1")

    slurm_env.setenv("SLURM_PROCID", "0")
    r = SlurmClusterResolver(tasks_per_node={"b": 1, "a": 2}, jobs={"worker": 3}, gpus_per_node=4)
    assert r.cluster_spec().as_dict() == {"worker": ["a:8888", "a:8889", "b:8888"]}
    assert (r.task_type, r.task_id, r.num_accelerators(), os.environ["CUDA_VISIBLE_DEVICES"]) == (
        "worker", 0, {"GPU": 2}, "0,1",
    )  # fmt: skip


@pytest.mark.serial("environment-only")
def test_slurm_resolver_errors_are_tfs(slurm_env):
    with pytest.raises(RuntimeError, match=r"Requested 8 tasks but only 7 were assigned\."):
        SlurmClusterResolver(jobs={"worker": 8})
    slurm_env.delenv("SLURM_PROCID")
    with pytest.raises(RuntimeError, match="SLURM_PROCID not found in environment"):
        SlurmClusterResolver()


@pytest.mark.serial("environment-only")
def test_slurm_resolver_reads_the_jobs_variables_outside_a_step_and_works_without_gpus(slurm_env):
    # Inside an sbatch script, before srun: only the job's variables. No GPU: tf's resolver fails here
    # (nvidia-smi missing, or a range of step 0); mpistrat's gives every task no GPU.
    for key in ("SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE"):
        slurm_env.delenv(key)
    slurm_env.setenv("SLURM_NTASKS", "4")
    slurm_env.setenv("SLURM_JOB_NODELIST", "tux[1-3]")
    slurm_env.setenv("SLURM_TASKS_PER_NODE", "2,1(x2)")
    slurm_env.setenv("CUDA_VISIBLE_DEVICES", "")
    r = SlurmClusterResolver()
    assert r.cluster_spec().as_dict() == {"worker": ["tux1:8888", "tux1:8889", "tux2:8888", "tux3:8888"]}
    assert (r.task_type, r.task_id, r.num_accelerators()) == ("worker", 3, {"GPU": 0})
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""  # left alone


# -- the strategies' resolvers ---------------------------------------------------------------------


def test_an_mpi_strategy_reports_its_ranks_as_workers(group):
    r = group.strategy.cluster_resolver
    hosts = group.comm.allgather(MPI.Get_processor_name())
    spec = r.cluster_spec()
    checks = RankChecks()
    checks.that((r.task_type, r.task_id) == ("worker", group.rank) and spec.jobs == ["worker"])
    checks.that([a.rsplit(":", 1)[0] for a in spec.job_tasks("worker")] == hosts)
    checks.that(len(set(spec.job_tasks("worker"))) == group.size)  # unique addresses
    checks.that(r.master() == spec.task_address("worker", group.rank))
    checks.that(r.num_accelerators() == ({} if group.strategy.extended.placement.gpu is None else {"GPU": 1}))
    checks.agree(group.comm, repr(r))


def test_the_default_strategy_has_no_resolver():
    # tf: tf.distribute.get_strategy().cluster_resolver is None
    assert mpistrat.get_strategy().cluster_resolver is None


@pytest.mark.timeout(60)
def test_multi_worker_strategy_checks_the_resolver_describes_this_job():
    world = MPI.COMM_WORLD
    n, rank = world.Get_size(), world.Get_rank()
    good = SimpleClusterResolver(
        ClusterSpec({"worker": [f"w{i}:1" for i in range(n)]}), task_type="worker", task_id=rank
    )
    strategy = mpistrat.MultiWorkerMirroredStrategy(cluster_resolver=good)
    ok = strategy.cluster_resolver is good and strategy.num_replicas_in_sync == n
    all_ranks_agree(world, ok, repr(strategy))
    if n > 1:  # a chief and workers: the chief is rank 0
        chief = SimpleClusterResolver(
            ClusterSpec({"chief": ["c:1"], "worker": [f"w{i}:1" for i in range(n - 1)]}),
            task_type="chief" if rank == 0 else "worker",
            task_id=0 if rank == 0 else rank - 1,
        )
        all_ranks_agree(world, mpistrat.MultiWorkerMirroredStrategy(chief).cluster_resolver is chief)
    too_many = SimpleClusterResolver(
        ClusterSpec({"worker": [f"w{i}:1" for i in range(n + 1)]}), task_type="worker", task_id=rank
    )
    raises_on_every_rank(
        world,
        InvalidArgumentError,
        lambda: mpistrat.MultiWorkerMirroredStrategy(cluster_resolver=too_many),
        f"describes {n + 1} chief and worker tasks, but MPI started {n} ranks",
    )
    if n > 1:  # one rank claims another's task: every rank hears of it
        swapped = SimpleClusterResolver(
            ClusterSpec({"worker": [f"w{i}:1" for i in range(n)]}), task_type="worker", task_id=(rank + 1) % n
        )
        raises_on_every_rank(
            world,
            InvalidArgumentError,
            lambda: mpistrat.MultiWorkerMirroredStrategy(swapped),
            "this is MPI rank",
        )
    raises_on_every_rank(
        world, InvalidArgumentError, lambda: mpistrat.MultiWorkerMirroredStrategy(cluster_resolver="worker"),
        "must be an mpistrat.cluster_resolver",
    )  # fmt: skip

#!/bin/sh
# Two virtual nodes, one rank each, over a 1 Gbit/s link, for a benchmark between nodes (root).
#
#     sh benchmarks/two_nodes.sh python -m benchmarks.overlap --compute-ms 8 --repeat 10
#     sh benchmarks/two_nodes.sh -env MPICH_ASYNC_PROGRESS 1 python -m benchmarks.overlap ...
#
# tests/support/nodes.py's launcher (each host name its own UTS namespace, so MPI takes its network
# path between them); UCX's TCP ports (45056-45183) go through an HTB class of 1 Gbit/s on the
# loopback, both directions sharing it; nothing else on the loopback is shaped. MPIEXEC: Hydra's.
set -eu
hosts=$(mktemp)
printf 'nodea:1\nnodeb:1\n' > "$hosts"
tc qdisc add dev lo root handle 1: htb default 10
trap 'tc qdisc del dev lo root; rm -f "$hosts"' EXIT
tc class add dev lo parent 1: classid 1:10 htb rate 100gbit
tc class add dev lo parent 1: classid 1:20 htb rate 1gbit
tc filter add dev lo parent 1: protocol ip prio 1 u32 match ip sport 45056 0xff80 flowid 1:20
tc filter add dev lo parent 1: protocol ip prio 1 u32 match ip dport 45056 0xff80 flowid 1:20
"${MPIEXEC:-mpiexec}" -machinefile "$hosts" -launcher ssh -launcher-exec tests/support/fake_ssh.sh -n 2 \
    -env UCX_TLS tcp,self -env UCX_TCP_PORT_RANGE 45056-45183 "$@"

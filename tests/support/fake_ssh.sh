#!/bin/sh
# A stand-in for ssh that makes virtual nodes on this machine (tests/support/nodes.py).
#
# Hydra (MPICH's and Intel MPI's mpiexec) starts each host's proxy with `LAUNCHER [-x] HOST "COMMAND"`.
# This runs COMMAND here, in a new UTS namespace whose host name is HOST: MPI then sees one node per
# name (COMM_TYPE_SHARED splits by it, and messages between them take the library's network path).
# VNODE_CGROUPS="HOST=DIR ..." first moves the proxy, and so that node's ranks, into the cgroup DIR
# (a CPU quota: a slow node). VNODE_SHM=DIR gives each host a /dev/shm of its own, kept between jobs
# as a node's is: DIR/HOST, mounted there in a new mount namespace. Needs root (CAP_SYS_ADMIN).
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
host=$1
shift
for entry in $VNODE_CGROUPS; do
    if [ "${entry%%=*}" = "$host" ]; then
        echo $$ > "${entry#*=}/cgroup.procs" || exit 1
    fi
done
if [ -n "$VNODE_SHM" ]; then
    mkdir -p "$VNODE_SHM/$host" || exit 1
    exec unshare --uts --mount sh -c 'mount --bind "$1" /dev/shm && hostname "$2" && shift 2 && eval "$*"' \
        fake_ssh "$VNODE_SHM/$host" "$host" "$@"
fi
exec unshare --uts sh -c 'hostname "$1" && shift && eval "$*"' fake_ssh "$host" "$@"

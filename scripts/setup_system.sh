#!/usr/bin/env bash
# Operating-system packages the test suite needs: an OpenSSH server and iproute2 for the
# network-namespace test cluster, pdsh for the pdsh launcher test, Open MPI (mpirun) and Slurm
# (slurmctld, slurmd, srun, munge) for the openmpi and slurm launcher tests, which run real jobs
# on that cluster. Installed only when missing, only as root on a Debian-like system;
# elsewhere the testbed tests say what is missing (and fail under CI=true).
set -euo pipefail
PKGS=()
[ -x /usr/sbin/sshd ] || PKGS+=(openssh-server)
command -v ssh >/dev/null 2>&1 || PKGS+=(openssh-client)
command -v ip >/dev/null 2>&1 || PKGS+=(iproute2)
command -v pdsh >/dev/null 2>&1 || PKGS+=(pdsh)
command -v mpirun >/dev/null 2>&1 || PKGS+=(openmpi-bin)
{ command -v slurmctld && command -v slurmd && command -v srun; } >/dev/null 2>&1 || PKGS+=(slurm-wlm)
command -v munged >/dev/null 2>&1 || PKGS+=(munge)
command -v unshare >/dev/null 2>&1 || PKGS+=(util-linux)   # the test cluster gives each host its own hostname
[ "${#PKGS[@]}" -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "setup: not root or no apt-get; not installing ${PKGS[*]}" >&2
    exit 0
fi
echo "setup: installing ${PKGS[*]}" >&2
# Debian's postinst would start a system sshd on 0.0.0.0:22; policy-rc.d forbids that.
if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    # removed again however apt-get ends, so the machine's services behave as before afterwards
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends "${PKGS[@]}" >/dev/null
exit 0

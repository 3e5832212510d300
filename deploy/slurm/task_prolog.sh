#!/bin/bash
# h5serve SLURM TaskProlog: point every task of the job at its node's daemon.
#
# slurm.conf: TaskProlog=/etc/slurm/h5serve/task_prolog.sh (see prolog.sh).
#
# slurmstepd runs the TaskProlog as the job user, with the task's environment, before each
# task starts, and reads its standard output: a line `export NAME=value` sets NAME in the
# task's environment (`unset NAME` removes one, `print ...` writes to the task's output).
# Anything else this script prints would be misread, so it prints only that one line.
#
# The line is printed only when the prolog registered this job on the user's kept daemon
# (H5SERVE_KEEP_S: its hold /run/h5serve/.holds/$UID/$SLURM_JOB_ID, in root's directory, then
# /run/h5serve/user-$UID) or started a daemon for this job (its runtime dir
# /run/h5serve/$SLURM_JOB_ID exists), and the user has not chosen a runtime dir already;
# otherwise the task keeps its environment, and h5serve clients fall back to their defaults.

set -u

uid=$(id -u)
dir=/run/h5serve/${SLURM_JOB_ID:-none}
[ ! -f "/run/h5serve/.holds/$uid/${SLURM_JOB_ID:-none}" ] || dir=/run/h5serve/user-$uid
if [ -n "${SLURM_JOB_ID:-}" ] && [ -z "${H5SERVE_RUNTIME_DIR:-}" ] && [ -d "$dir" ]; then
    echo "export H5SERVE_RUNTIME_DIR=$dir"
fi
exit 0

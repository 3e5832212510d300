#!/bin/bash
# h5serve SLURM node epilog: stop the job's daemon and remove its runtime dir.
#
# slurm.conf: Epilog=/etc/slurm/h5serve/epilog.sh (see prolog.sh for the whole setup).
#
# Runs as root on every node of every job at job end; acts only where the prolog left a
# runtime dir (/run/h5serve/$SLURM_JOB_ID), so it needs no opt-in check and is idempotent.
#
# 1. `h5serve stop`: the daemon unlinks every segment of the job and exits. Processes that
#    still map a segment keep reading it until they unmap; the memory is freed after that.
# 2. If the daemon does not stop (hung, or already killed): SIGTERM, then SIGKILL, then
#    remove the segments it left in /dev/shm. Only this job's segments match: their names
#    carry the job user's uid and a hash of this job's runtime dir.
# 3. Remove the runtime dir (socket, pidfile, log) and the systemd env file.
#
# Fail open: failures are logged with `logger -t h5serve` and the script exits 0. A failing
# epilog drains the node.

set -u

PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
CONFIG=${H5SERVE_SLURM_CONFIG:-/etc/default/h5serve-slurm}
RUN_ROOT=/run/h5serve
ENV_ROOT=/run/h5serve-jobs

log() {
    logger -t h5serve -- "epilog job ${SLURM_JOB_ID:-?} on ${SLURMD_NODENAME:-$(hostname)}: $*" 2>/dev/null || true
}

daemon_pid() {
    # The daemon's pid, if a daemon runs on runtime dir $1. A live daemon holds an exclusive
    # flock on its pidfile for its whole life (that is how h5serve itself tells), so a pid
    # reused by an unrelated process is never mistaken for it.
    local pidfile=$1/h5serve.pid pid
    [ -e "$pidfile" ] || return 1
    if command -v flock >/dev/null 2>&1 && flock --nonblock --shared "$pidfile" true 2>/dev/null; then
        return 1  # nobody holds the lock: no daemon
    fi
    pid=$(cat "$pidfile" 2>/dev/null) || return 1
    case "$pid" in "" | *[!0-9]*) return 1 ;; esac
    kill -0 "$pid" 2>/dev/null || return 1
    echo "$pid"
}

remove_leftover_segments() {
    # Segment names are h5serve-<uid>-<namespace>-<hash> in the shm dir, where namespace is
    # blake2b(runtime dir, 4 bytes) (h5serve.runtime.RuntimeLocation.namespace,
    # h5serve.segments.segment_prefix). Only reached when no daemon runs on the dir.
    local dir=$1 uid=${SLURM_JOB_UID:-} ns shm=${H5SERVE_SHM_DIR:-/dev/shm}
    case "$uid" in "" | *[!0-9]*) log "SLURM_JOB_UID not set; leftover segments (if any) stay in $shm"; return 0 ;; esac
    ns=$(python3 -c 'import hashlib, sys; print(hashlib.blake2b(sys.argv[1].encode(), digest_size=4).hexdigest())' "$dir") \
        || { log "python3 not found; leftover segments (if any) stay in $shm"; return 0; }
    local f found=0
    for f in "$shm/h5serve-$uid-$ns-"*; do
        [ -e "$f" ] || continue
        rm -f -- "$f" && found=$((found + 1))
    done
    [ "$found" -eq 0 ] || log "removed $found leftover segment file(s) of $dir from $shm"
}

main() {
    H5SERVE_BIN=h5serve
    if [ -e "$CONFIG" ]; then
        # shellcheck source=/dev/null
        . "$CONFIG" || log "cannot read $CONFIG; using defaults"
    fi
    local job=${SLURM_JOB_ID:-}
    case "$job" in
        "" | *[!0-9]*) log "SLURM_JOB_ID='$job' is not a job id; is this running as a slurmd Epilog?"; return 1 ;;
    esac
    local dir=$RUN_ROOT/$job

    # A systemd instance (H5SERVE_LAUNCH=systemd, or started by hand): stopping it sends
    # SIGTERM and its ExecStopPost removes the dir and env file. Harmless when not loaded.
    if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet "h5serve@$job.service" 2>/dev/null; then
        timeout 60 systemctl stop "h5serve@$job.service" || log "systemctl stop h5serve@$job.service failed"
    fi

    if [ -d "$dir" ]; then
        if daemon_pid "$dir" >/dev/null; then
            local out
            out=$(timeout 60 "$H5SERVE_BIN" stop --runtime-dir "$dir" 2>&1) || log "h5serve stop failed: ${out//$'\n'/ | }"
        fi
        local pid
        if pid=$(daemon_pid "$dir"); then
            log "daemon (pid $pid) still running after stop; sending SIGTERM"
            kill -TERM "$pid" 2>/dev/null
            local i
            for i in 1 2 3 4 5 6 7 8 9 10; do
                daemon_pid "$dir" >/dev/null || break
                sleep 1
            done
            if pid=$(daemon_pid "$dir"); then
                log "daemon (pid $pid) ignored SIGTERM for ${i}s; sending SIGKILL"
                kill -KILL "$pid" 2>/dev/null
                sleep 1
            fi
        fi
        if daemon_pid "$dir" >/dev/null; then
            log "daemon on $dir cannot be stopped; leaving $dir and its segments"
            return 1
        fi
        remove_leftover_segments "$dir"
        rm -rf -- "$dir" || log "cannot remove $dir"
    fi
    rm -f -- "$ENV_ROOT/$job.env" "$ENV_ROOT/$job.env.tmp"
    return 0
}

( main ) || log "cleanup incomplete (exit $?); see the lines above"
exit 0

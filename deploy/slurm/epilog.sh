#!/bin/bash
# h5serve SLURM node epilog: stop the job's daemon and remove its runtime dir.
#
# slurm.conf: Epilog=/etc/slurm/h5serve/epilog.sh (see prolog.sh for the whole setup).
#
# Runs as root on every node of every job at job end; acts only where the prolog left
# something (/run/h5serve/$SLURM_JOB_ID, or a hold in /run/h5serve/.holds/<uid>), so it needs
# no opt-in check and is idempotent.
#
# Per-job daemon (/run/h5serve/$SLURM_JOB_ID). Everything in that dir belongs to the job's
# user, who may have rewritten it: the pidfile can name any process, be a FIFO or a symlink.
# So root never reads, follows, signals or deletes on the strength of it. Every step that
# touches the user's files or processes runs as the job's user (setpriv), with a timeout:
# 1. `h5serve stop`: the daemon unlinks its segments and exits.
# 2. If it still runs: SIGTERM (and SIGCONT), then SIGKILL after 10 s, to its process group
#    (the daemon leads its own session: its forkserver and loaders go with it), sent as the
#    job user, and only to a process of the job's uid that holds the exclusive flock on the
#    runtime dir's pidfile (the daemon holds it all its life) or, when the pidfile was
#    replaced, that runs `h5serve.daemon --runtime-dir <this dir>` and holds an exclusive flock.
# 3. Remove the segments it left in /dev/shm: regular files of the job's uid whose names carry
#    that uid and a hash of the runtime dir.
# 4. Remove the runtime dir's contents as the job user, then the empty dir as root.
#
# Kept daemon (H5SERVE_KEEP_S, /run/h5serve/user-<uid>): the daemon exits on its own
# (--idle-exit) once none of its user's jobs holds it; the epilog only removes this job's hold.
#
# Also called by prolog.sh as `epilog.sh --make-room UID BYTES` (a job of UID needs BYTES of
# /dev/shm for a new daemon: stop idle kept daemons of other users, least recently used first,
# while less is free), and by an admin as `epilog.sh --stop-idle` (stop every idle kept daemon).
#
# Fail open: failures are logged with `logger -t h5serve` and the script exits 0. A failing
# epilog drains the node.

set -euo pipefail
cd /

PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
CONFIG=${H5SERVE_SLURM_CONFIG:-/etc/default/h5serve-slurm}
RUN_ROOT=/run/h5serve
ENV_ROOT=/run/h5serve-jobs
ROOT_STATE=$RUN_ROOT/.root    # 0700, root's: root's lock (prolog.sh)
HOLDS=$RUN_ROOT/.holds        # 0755, root's: <uid>/<job id>, one per running job on a kept daemon
LOCK_WAIT_S=60                # at most this long for root's lock
TERM_GRACE_S=10               # SIGTERM to SIGKILL
STATUS_TIMEOUT_S=5            # a kept daemon that does not answer `status` in time is not idle
IDLE_MIN_S=2                  # idle: the daemon's own look (once a second) found nothing in use
SHM=${H5SERVE_SHM_DIR:-/dev/shm}
ROLE=epilog   # in the log: "prolog" when the prolog runs --make-room
JOB_UID=""
JOB_GID=""
AS_JOB_USER=()  # setpriv prefix: the uid and gid set by job_identity, no other groups

log() {
    local line="$ROLE job ${SLURM_JOB_ID:-?} on ${SLURMD_NODENAME:-$(hostname)}: $*"
    logger -t h5serve -- "$line" 2>/dev/null || true
    # H5SERVE_LOG (site config): also append to this root-owned file (nodes without syslog)
    [ -z "${H5SERVE_LOG:-}" ] || printf '%s h5serve: %s\n' "$(date '+%F %T')" "$line" >> "$H5SERVE_LOG" 2>/dev/null || true
}

config_trusted() {
    # The config is sourced as root: a regular file of root's that only root can write.
    local perms
    [ -f "$1" ] && [ ! -L "$1" ] || return 1
    perms=$(stat -c '%u %a' -- "$1" 2>/dev/null) || return 1
    case "$perms" in "0 "*[0-7][0145][0145]) return 0 ;; esac
    return 1
}

numeric() { case "${1:-}" in "" | *[!0-9]*) return 1 ;; esac; }

job_identity() {
    # Sets JOB_UID, JOB_GID and AS_JOB_USER for uid $1, gid $2 (slurmd's SLURM_JOB_GID) if
    # given, else the group of runtime dir $3 (root made it with the user's group; the user can
    # only move it to a group they are in), else the uid's primary group. Nothing else changes.
    JOB_UID=$1
    numeric "$JOB_UID" || { log "uid '$JOB_UID' is not a uid; leaving everything as it is"; return 1; }
    [ "$JOB_UID" -ne 0 ] || { log "a job of root: h5serve starts no daemon for root; nothing to do"; return 1; }
    JOB_GID=${2:-}
    numeric "$JOB_GID" || JOB_GID=$(stat -c %g -- "$3" 2>/dev/null) || JOB_GID=""
    numeric "$JOB_GID" || JOB_GID=$(timeout 10 getent passwd "$JOB_UID" | cut -d: -f4) || JOB_GID=""
    numeric "$JOB_GID" || { log "no group for uid $JOB_UID; leaving everything as it is"; return 1; }
    command -v setpriv >/dev/null 2>&1 || { log "setpriv not found (util-linux); leaving everything as it is"; return 1; }
    # Whatever runs with this prefix can only touch what the job user could: a path or pid
    # the user planted gains them nothing.
    AS_JOB_USER=(setpriv --reuid="$JOB_UID" --regid="$JOB_GID" --clear-groups --)
}

pidfile_pid() {
    # The pid in runtime dir $1's pidfile: read as the job user, only from a regular file, at
    # most 32 bytes, with a timeout (a FIFO swapped in after the check must not hang the node).
    local pidfile=$1/h5serve.pid pid
    [ -f "$pidfile" ] && [ ! -L "$pidfile" ] || return 1
    pid=$(timeout -k 1 5 "${AS_JOB_USER[@]}" head -c 32 -- "$pidfile" 2>/dev/null) || return 1
    pid=${pid%$'\n'}
    case "$pid" in "" | *[!0-9]* | 0*) return 1 ;; esac
    echo "$pid"
}

owned_by_job() {
    # True when process $1 runs with the job's uid (real, effective, saved and filesystem).
    local key real effective saved fs
    while read -r key real effective saved fs; do
        [ "$key" = "Uid:" ] || continue
        [ "$real" = "$JOB_UID" ] && [ "$effective" = "$JOB_UID" ] && [ "$saved" = "$JOB_UID" ] && [ "$fs" = "$JOB_UID" ]
        return
    done 2>/dev/null < "/proc/$1/status"
    return 1
}

holds_write_flock() {
    # True when process $1 holds an exclusive flock, on inode $2 when given (/proc/locks
    # lines: "N: FLOCK ADVISORY WRITE <pid> <major>:<minor>:<inode> 0 EOF"; waiters are
    # "N: -> FLOCK ..." and do not count). awk, not a bash read loop: a user holding thousands
    # of locks makes the file long, and bash reads it a byte per system call.
    # shellcheck disable=SC2016  # awk's own $ fields
    timeout 10 awk -v pid="$1" -v ino="${2:-}" '
        $2 == "FLOCK" && $4 == "WRITE" && $5 == pid {
            n = split($6, dev, ":")
            if (ino == "" || dev[n] == ino) { found = 1; exit }
        }
        END { exit !found }' /proc/locks
}

runs_daemon_of() {
    # True when process $1's command line is `... -m h5serve.daemon ... --runtime-dir $2 ...`.
    local args
    args=$'\n'$(tr '\0' '\n' 2>/dev/null < "/proc/$1/cmdline")$'\n' || return 1
    case "$args" in *$'\n'h5serve.daemon$'\n'*) ;; *) return 1 ;; esac
    case "$args" in *$'\n'--runtime-dir$'\n'"$2"$'\n'*) return 0 ;; esac
    return 1
}

daemon_pids() {
    # The daemon of runtime dir $1, verified: a process of the job's uid holding the exclusive
    # flock on the pidfile's inode; if the pidfile was replaced, processes of the job's uid
    # that run h5serve.daemon on this dir and hold an exclusive flock.
    local dir=$1 pid ino found=1 status
    if pid=$(pidfile_pid "$dir") && ino=$(stat -c %i -- "$dir/h5serve.pid" 2>/dev/null) \
        && owned_by_job "$pid" && holds_write_flock "$pid" "$ino"; then
        echo "$pid"
        return 0
    fi
    for status in /proc/[0-9]*/status; do
        pid=${status#/proc/}
        pid=${pid%/status}
        if owned_by_job "$pid" && runs_daemon_of "$pid" "$dir" && holds_write_flock "$pid"; then
            echo "$pid"
            found=0
        fi
    done
    return $found
}

as_job_user_kill() {
    # kill -$1 $2 (a pid, or -pgid) as the job user: nothing the user could not signal.
    timeout -k 1 5 "${AS_JOB_USER[@]}" kill "-$1" -- "$2" 2>/dev/null
}

stop_daemon() {
    # Stop runtime dir $1's daemon and its process group: `h5serve stop` as the job user
    # (unless $2 is "signals"), then SIGTERM and SIGCONT, SIGKILL after TERM_GRACE_S, to each
    # verified daemon's group (it leads its own session: `h5serve start` starts it so). False
    # if it still runs.
    local dir=$1 out pids pid i
    pids=$(daemon_pids "$dir" | tr '\n' ' ') || return 0
    pids=${pids% }
    if [ "${2:-}" != signals ]; then
        out=$(timeout -k 5 40 "${AS_JOB_USER[@]}" "$H5SERVE_BIN" stop --runtime-dir "$dir" 2>&1) \
            || log "h5serve stop failed: ${out//$'\n'/ | }"
    fi
    if daemon_pids "$dir" >/dev/null; then
        log "daemon (pid $pids) running; sending SIGTERM to its process group"
        for pid in $pids; do as_job_user_kill TERM "-$pid" || as_job_user_kill TERM "$pid" || true; done
        for pid in $pids; do as_job_user_kill CONT "-$pid" || true; done  # a stopped daemon handles SIGTERM once continued
        for ((i = 0; i < TERM_GRACE_S * 5; i++)); do
            daemon_pids "$dir" >/dev/null || break
            sleep 0.2
        done
    fi
    # SIGKILL to what is left of each group: a daemon that ignored SIGTERM, its loaders
    for pid in $pids; do as_job_user_kill KILL "-$pid" || true; done
    for ((i = 0; i < 10; i++)); do
        daemon_pids "$dir" >/dev/null || return 0
        sleep 0.2
    done
    log "daemon (pid $pids) survived SIGKILL"
    return 1
}

namespace_of() {
    # blake2b(runtime dir, 4 bytes) in hex, as h5serve.wire.runtime.RuntimeLocation.namespace.
    local ns
    if command -v b2sum >/dev/null 2>&1; then
        ns=$(printf %s "$1" | timeout 10 b2sum -l 32) || return 1
    else
        ns=$(timeout 10 python3 -c 'import hashlib, sys; print(hashlib.blake2b(sys.argv[1].encode(), digest_size=4).hexdigest())' "$1") \
            || return 1
    fi
    ns=${ns%% *}
    case "$ns" in ????????) echo "$ns" ;; *) return 1 ;; esac
}

remove_leftover_segments() {
    # Segment names are h5serve-<uid>-<namespace>-<hash> (h5serve.segments.segment_prefix).
    # Only regular files of the job's uid are removed, by the job user.
    local dir=$1 ns removed
    ns=$(namespace_of "$dir") || { log "cannot hash $dir (no b2sum or python3); leftover segments stay in $SHM"; return 0; }
    removed=$(timeout -k 5 20 "${AS_JOB_USER[@]}" \
        find "$SHM" -maxdepth 1 -type f -user "$JOB_UID" -name "h5serve-$JOB_UID-$ns-*" -print -delete 2>/dev/null | wc -l) \
        || log "removing leftover segments of $dir from $SHM failed or timed out"
    [ "${removed:-0}" -eq 0 ] || log "removed $removed leftover segment file(s) of $dir from $SHM"
}

remove_runtime_dir() {
    # The dir's entries are the job user's: removed by that user (no symlink followed); the dir
    # itself, in root's $RUN_ROOT, by root once it is empty.
    local dir=$1 owner
    owner=$(stat -c %u -- "$dir" 2>/dev/null) || return 0
    if [ "$owner" = "$JOB_UID" ]; then
        timeout -k 5 20 "${AS_JOB_USER[@]}" find "$dir" -mindepth 1 -delete 2>/dev/null || true
    fi
    rmdir -- "$dir" 2>/dev/null || log "cannot remove $dir (owner uid $owner): not empty or not a directory; left as it is"
}

retire() {
    # Stop runtime dir $1's daemon ($2: "signals" to skip `h5serve stop`), remove its leftover
    # segments and the dir. job_identity done.
    if ! stop_daemon "$1" "${2:-}"; then
        log "daemon on $1 cannot be stopped; leaving $1 and its segments"
        return 1
    fi
    remove_leftover_segments "$1"
    remove_runtime_dir "$1"
}

load_config() {
    H5SERVE_BIN=h5serve
    if [ -e "$CONFIG" ]; then
        if config_trusted "$CONFIG"; then
            # shellcheck source=/dev/null
            . "$CONFIG" || log "cannot read $CONFIG; using defaults"
        else
            log "$CONFIG is not a regular file that only root can write; ignoring it"
        fi
    fi
}

# ----- kept daemons (H5SERVE_KEEP_S > 0): one per user per node, /run/h5serve/user-<uid> ---------

held() {
    # True while uid $1 has a job registered on this node (its holds; a missing dir: none).
    [ -n "$(ls -A -- "$HOLDS/$1" 2>/dev/null)" ]
}

shm_free() {
    local line
    line=$(df -B1 --output=avail -- "$SHM" 2>/dev/null) || return 1
    line=${line##*$'\n'}
    line=${line// /}
    numeric "$line" && echo "$line"
}

idle_report() {
    # "<idle seconds> <bytes used>" for runtime dir $1's daemon, as it reports them (`h5serve
    # status --json`, asked as its user, answered within STATUS_TIMEOUT_S), when it says it is
    # idle: started with --idle-exit (a kept daemon), no hold, unused for IDLE_MIN_S or more.
    local json
    json=$(timeout -k 1 "$STATUS_TIMEOUT_S" "${AS_JOB_USER[@]}" "$H5SERVE_BIN" status --json --runtime-dir "$1" \
        2>/dev/null | head -c 16777216) || return 1
    printf %s "$json" | timeout 10 python3 -I -c '
import json, sys
s = json.load(sys.stdin)
idle = s.get("idle_exit") or {}
if idle and not idle.get("holds") and float(idle["idle_s"]) >= float(sys.argv[1]):
    print("%.3f" % float(idle["idle_s"]), int(s["memory"]["used"]))
else:
    sys.exit(1)' "$IDLE_MIN_S" 2>/dev/null
}

root_lock() {
    # fd 9: root's lock, in the root-only $ROOT_STATE (no user can open it), waited for at most
    # LOCK_WAIT_S. Everything done under it is bounded (TERM_GRACE_S, timeouts).
    [ -d "$ROOT_STATE" ] && [ ! -L "$ROOT_STATE" ] && [ "$(stat -c '%u %a' -- "$ROOT_STATE")" = "0 700" ] \
        || { log "$ROOT_STATE is not root's 0700 directory"; return 1; }
    exec 9>>"$ROOT_STATE/lock" || return 1
    flock -w "$LOCK_WAIT_S" 9 || { exec 9>&-; log "waited ${LOCK_WAIT_S}s for $ROOT_STATE/lock; giving up"; return 1; }
}

make_room() {
    # A new daemon for a job of uid $1 will use $2 bytes of /dev/shm: while less is free, stop
    # the idle kept daemons of other users (each says it is idle, none has a job here), least
    # recently used first. $1 empty: every user's. Each stop is logged with what was needed.
    local job_uid=$1 need=$2 free dir uid report list="" idle used
    free=$(shm_free) || { log "cannot read the free space of $SHM; stopping no kept daemon"; return 0; }
    [ "$free" -lt "$need" ] || return 0
    for dir in "$RUN_ROOT"/user-*; do
        uid=${dir##*/user-}
        numeric "$uid" && [ "$uid" != "$job_uid" ] && [ -d "$dir" ] && [ ! -L "$dir" ] || continue
        held "$uid" && continue
        # the user's daemon reports, as the user: not idle, no answer or no group: not stopped
        report=$(job_identity "$uid" "" "$dir" && idle_report "$dir") || continue
        list+="$report $uid"$'\n'
    done
    while read -r idle used uid; do
        numeric "$uid" || continue
        root_lock || return 0
        # under the lock: the user's next prolog registers its hold under it before reusing the daemon
        if free=$(shm_free) && [ "$free" -lt "$need" ] && ! held "$uid"; then
            log "stopping the idle kept daemon of uid $uid (unused for ${idle}s, $used bytes) for a job of uid ${job_uid:-none}: $free bytes free in $SHM, $need needed"
            ( job_identity "$uid" "" "$RUN_ROOT/user-$uid" && retire "$RUN_ROOT/user-$uid" signals ) || true
        fi
        exec 9>&-
        [ -n "$free" ] && [ "$free" -lt "$need" ] || return 0
    done < <(printf %s "$list" | LC_ALL=C sort -rn)
}

main() {
    load_config
    case "${1:-}" in
        --make-room)
            ROLE=prolog
            { numeric "${2:-}" && numeric "${3:-}"; } || { log "usage: --make-room UID BYTES"; return 1; }
            make_room "$2" "$3"
            return
            ;;
        --stop-idle)
            make_room "" 4611686018427387904
            return
            ;;
    esac
    local job=${SLURM_JOB_ID:-} uid=${SLURM_JOB_UID:-}
    numeric "$job" || { log "SLURM_JOB_ID='$job' is not a job id; is this running as a slurmd Epilog?"; return 1; }
    local dir=$RUN_ROOT/$job

    # This job's hold on its user's kept daemon: the daemon exits on its own once it has none.
    if numeric "$uid" && [ -e "$HOLDS/$uid/$job" ]; then
        rm -f -- "$HOLDS/$uid/$job" || log "cannot remove the hold $HOLDS/$uid/$job"
    fi

    # A systemd instance (H5SERVE_LAUNCH=systemd, or started by hand): stopping it sends
    # SIGTERM and its ExecStopPost removes the dir and env file. Harmless when not loaded.
    if command -v systemctl >/dev/null 2>&1 && timeout 10 systemctl is-active --quiet "h5serve@$job.service" 2>/dev/null; then
        timeout 60 systemctl stop "h5serve@$job.service" || log "systemctl stop h5serve@$job.service failed"
    fi

    if [ -d "$dir" ] && [ ! -L "$dir" ]; then
        job_identity "$uid" "${SLURM_JOB_GID:-}" "$dir" || return 1
        retire "$dir" || return 1
    fi
    rm -f -- "$ENV_ROOT/$job.env" "$ENV_ROOT/$job.env".*
    return 0
}

( main "$@" ) || log "cleanup incomplete (exit $?); see the lines above"
exit 0

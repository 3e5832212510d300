#!/bin/bash
# h5serve SLURM node epilog: stop the job's daemon and remove its runtime dir.
#
# slurm.conf: Epilog=/etc/slurm/h5serve/epilog.sh (see prolog.sh for the whole setup).
#
# Runs as root on every node of every job at job end; acts only where the prolog left a
# runtime dir (/run/h5serve/$SLURM_JOB_ID), so it needs no opt-in check and is idempotent.
#
# Everything in that dir belongs to the job's user, who may have rewritten it: the pidfile
# can name any process, be a FIFO or a symlink. So root never reads, follows, signals or
# deletes on the strength of it. Every step that touches the user's files or processes runs
# as the job's user (setpriv), with a timeout:
#
# 1. `h5serve stop`, as the job user: the daemon unlinks every segment of the job and exits.
#    Processes that still map a segment keep reading it until they unmap.
# 2. If a daemon still runs: SIGTERM, then SIGKILL, sent as the job user, and only to a
#    process of the job's uid that holds the exclusive flock on the runtime dir's pidfile (the
#    daemon holds it all its life) or, when the pidfile was replaced, that runs
#    `h5serve.daemon --runtime-dir <this dir>` and holds an exclusive flock.
# 3. Remove the segments it left in /dev/shm, as the job user: regular files of the job's uid
#    whose names carry that uid and a hash of this job's runtime dir.
# 4. Remove the runtime dir's contents as the job user, then the empty dir as root; and the
#    systemd env file.
#
# Fail open: failures are logged with `logger -t h5serve` and the script exits 0. A failing
# epilog drains the node.

set -u
cd / || exit 0

PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
CONFIG=${H5SERVE_SLURM_CONFIG:-/etc/default/h5serve-slurm}
RUN_ROOT=/run/h5serve
ENV_ROOT=/run/h5serve-jobs
KEEP_ROOT=$RUN_ROOT/.keep        # H5SERVE_KEEP_S: root's bookkeeping of kept daemons (below)
KEEP_LOCK=$RUN_ROOT/.keep.lock
SELF=$(readlink -f -- "$0")
JOB_UID=""
JOB_GID=""
AS_JOB_USER=()  # setpriv prefix: the job's uid and gid, no other groups (set by job_identity)

log() {
    local line="epilog job ${SLURM_JOB_ID:-?} on ${SLURMD_NODENAME:-$(hostname)}: $*"
    logger -t h5serve -- "$line" 2>/dev/null || true
    # H5SERVE_LOG (site config): also append to this root-owned file (nodes without syslog)
    [ -z "${H5SERVE_LOG:-}" ] || printf '%s h5serve: %s\n' "$(date '+%F %T')" "$line" >> "$H5SERVE_LOG" 2>/dev/null || true
}

config_trusted() {
    # The config is sourced as root: a regular file of root's that only root can write.
    local perms
    [ -f "$1" ] && [ ! -L "$1" ] || return 1
    perms=$(stat -c '%u %a' -- "$1" 2>/dev/null) || return 1
    case "$perms" in
        "0 "*[0-7][0145][0145]) return 0 ;;
    esac
    return 1
}

job_identity() {
    # JOB_UID/JOB_GID from slurmd's environment (SLURM_JOB_GID, else the uid's primary group),
    # or from uid $1 (a kept daemon's owner, when reaping).
    JOB_UID=${1:-${SLURM_JOB_UID:-}}
    [ -z "${1:-}" ] || SLURM_JOB_GID=""
    case "$JOB_UID" in "" | *[!0-9]*) log "SLURM_JOB_UID='$JOB_UID' is not a uid; leaving everything as it is"; return 1 ;; esac
    if [ "$JOB_UID" -eq 0 ]; then
        log "job of root: h5serve starts no daemon for root jobs; nothing to do"
        return 1
    fi
    JOB_GID=${SLURM_JOB_GID:-}
    case "$JOB_GID" in
        "" | *[!0-9]*) JOB_GID=$(timeout 10 getent passwd "$JOB_UID" | cut -d: -f4) ;;
    esac
    case "$JOB_GID" in "" | *[!0-9]*) log "no group for uid $JOB_UID; leaving everything as it is"; return 1 ;; esac
    command -v setpriv >/dev/null 2>&1 || { log "setpriv not found (util-linux); leaving everything as it is"; return 1; }
    # Whatever runs with this prefix can only touch what the job user could: a path or pid
    # the user planted gains them nothing.
    AS_JOB_USER=(setpriv --reuid="$JOB_UID" --regid="$JOB_GID" --clear-groups --)
}

pidfile_pid() {
    # The pid written in the pidfile of runtime dir $1: read as the job user, only from a
    # regular file (no symlink), at most 32 bytes, with a timeout (a FIFO swapped in after the
    # check must not hang the node).
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
    # "N: -> FLOCK ..." and do not count).
    local _n kind _adv mode pid dev _rest
    while read -r _n kind _adv mode pid dev _rest; do
        if [ "$kind" = FLOCK ] && [ "$mode" = WRITE ] && [ "$pid" = "$1" ] \
            && { [ -z "${2:-}" ] || [ "${dev##*:}" = "$2" ]; }; then
            return 0
        fi
    done < /proc/locks
    return 1
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
    # The daemon of runtime dir $1, verified: a process of the job's uid holding the
    # exclusive flock on the pidfile's inode. If the pidfile was replaced (its inode is no
    # longer the locked one), processes of the job's uid that run h5serve.daemon on this dir
    # and hold an exclusive flock. Signals go out as the job user either way.
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

signal_daemon() {
    # Send signal $1 to the verified daemon of runtime dir $2, as the job user.
    local pid
    for pid in $(daemon_pids "$2"); do
        timeout -k 1 5 "${AS_JOB_USER[@]}" kill "-$1" "$pid" 2>/dev/null \
            || log "cannot send SIG$1 to pid $pid"
    done
}

stop_daemon() {
    # `h5serve stop` as the job user, then SIGTERM, then SIGKILL. False if it still runs.
    local dir=$1 out i
    out=$(timeout -k 5 40 "${AS_JOB_USER[@]}" \
        "$H5SERVE_BIN" stop --runtime-dir "$dir" 2>&1) || log "h5serve stop failed: ${out//$'\n'/ | }"
    daemon_pids "$dir" >/dev/null || return 0
    log "daemon (pid $(daemon_pids "$dir" | tr '\n' ' ')) still running after stop; sending SIGTERM"
    signal_daemon TERM "$dir"
    signal_daemon CONT "$dir"  # a stopped (SIGSTOP) daemon handles SIGTERM only once continued
    for i in 1 2 3 4 5 6 7 8 9 10; do
        daemon_pids "$dir" >/dev/null || return 0
        sleep 1
    done
    log "daemon ignored SIGTERM for ${i}s; sending SIGKILL"
    signal_daemon KILL "$dir"
    sleep 1
    ! daemon_pids "$dir" >/dev/null
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
    # Segment names are h5serve-<uid>-<namespace>-<hash> in the shm dir (see
    # h5serve.segments.segment_prefix). Only regular files of the job's uid are removed, by
    # the job user: another user's file under the same prefix is never touched.
    local dir=$1 ns shm=${H5SERVE_SHM_DIR:-/dev/shm} removed
    ns=$(namespace_of "$dir") || { log "cannot hash $dir (no b2sum or python3); leftover segments stay in $shm"; return 0; }
    removed=$(timeout -k 5 60 "${AS_JOB_USER[@]}" \
        find "$shm" -maxdepth 1 -type f -user "$JOB_UID" -name "h5serve-$JOB_UID-$ns-*" -print -delete 2>/dev/null | wc -l)
    [ "${removed:-0}" -eq 0 ] || log "removed $removed leftover segment file(s) of $dir from $shm"
}

remove_runtime_dir() {
    # The dir's entries are the job user's: removed by that user (no symlink followed, nothing
    # of root's reachable); the dir itself, in root's $RUN_ROOT, by root once it is empty.
    local dir=$1 owner
    owner=$(stat -c %u -- "$dir" 2>/dev/null) || return 0
    if [ "$owner" = "$JOB_UID" ]; then
        timeout -k 5 60 "${AS_JOB_USER[@]}" \
            find "$dir" -mindepth 1 -delete 2>/dev/null
    fi
    rmdir -- "$dir" 2>/dev/null || log "cannot remove $dir (owner uid $owner): not empty or not a directory; left as it is"
}

load_config() {
    H5SERVE_BIN=h5serve
    H5SERVE_KEEP_S=0
    if [ -e "$CONFIG" ]; then
        if config_trusted "$CONFIG"; then
            # shellcheck source=/dev/null
            . "$CONFIG" || log "cannot read $CONFIG; using defaults"
        else
            log "$CONFIG is not a regular file that only root can write; ignoring it"
        fi
    fi
    case "$H5SERVE_KEEP_S" in "" | *[!0-9]*) log "H5SERVE_KEEP_S='$H5SERVE_KEEP_S' is not a number of seconds; 0"; H5SERVE_KEEP_S=0 ;; esac
}

# ----- kept daemons (H5SERVE_KEEP_S > 0): one per user per node, /run/h5serve/user-<uid> ---------
#
# Root's bookkeeping, in $KEEP_ROOT (0700: no user can read or forge it), changed only under an
# exclusive flock on $KEEP_LOCK, which the prolog holds too while it registers a job and starts
# or reuses the daemon. So the last epilog of a user racing that user's next prolog either
# stops the daemon before the prolog starts one, or sees the new job and leaves it.
#   $KEEP_ROOT/<uid>/jobs/<job id>   the user's jobs running on this node
#   $KEEP_ROOT/<uid>/idle-since      when the last of them ended (epoch seconds)
# A daemon with no job for H5SERVE_KEEP_S seconds is stopped by whichever comes first: the
# timer the epilog arms when a user's last job ends (one per node: `epilog.sh --timer`,
# detached, sleeping until the next expiry, at most 30 s at a time; it exits when no kept
# daemon is idle), or the next prolog or epilog of any user.

keep_lock() {
    # fd 9: the exclusive lock on $KEEP_LOCK, in root's $RUN_ROOT (a real dir of root's: no user
    # can plant the name), waited for at most 120 s.
    [ -d "$RUN_ROOT" ] && [ ! -L "$RUN_ROOT" ] && [ "$(stat -c %u -- "$RUN_ROOT")" = 0 ] || return 1
    exec 9>>"$KEEP_LOCK" || return 1
    flock -w 120 9 || { log "waited 120 s for $KEEP_LOCK; giving up"; return 1; }
}

keep_unlock() {
    exec 9>&-
}

stop_kept() {
    # Stop uid $1's kept daemon, remove its segments, runtime dir and bookkeeping. Lock held.
    local uid=$1 dir=$RUN_ROOT/user-$1
    job_identity "$uid" || { rm -rf -- "${KEEP_ROOT:?}/$uid"; return 0; }
    if [ -d "$dir" ] && [ ! -L "$dir" ]; then
        if ! stop_daemon "$dir"; then
            log "kept daemon of uid $uid on $dir cannot be stopped; leaving it"
            return 1
        fi
        remove_leftover_segments "$dir"
        remove_runtime_dir "$dir"
    fi
    rm -rf -- "${KEEP_ROOT:?}/$uid"
}

idle_for() {
    # Seconds uid $1 has had no job on this node; nothing (false) while it has one.
    local since
    [ -z "$(ls -A -- "$KEEP_ROOT/$1/jobs" 2>/dev/null)" ] || return 1
    since=$(head -c 20 -- "$KEEP_ROOT/$1/idle-since" 2>/dev/null) || since=0
    case "$since" in "" | *[!0-9]*) since=0 ;; esac
    echo $(( $(date +%s) - since ))
}

reap_expired() {
    # Stop every kept daemon idle for H5SERVE_KEEP_S seconds or more. Lock held. Prints the
    # seconds until the next expiry, if a kept daemon is idle but not yet expired.
    local state uid idle next=""
    for state in "$KEEP_ROOT"/*; do
        [ -d "$state" ] || continue
        uid=${state##*/}
        case "$uid" in "" | *[!0-9]*) continue ;; esac
        idle=$(idle_for "$uid") || continue
        if [ "$idle" -ge "$H5SERVE_KEEP_S" ]; then
            log "stopping the kept daemon of uid $uid: no job for ${idle}s (H5SERVE_KEEP_S=$H5SERVE_KEEP_S)"
            stop_kept "$uid"
        elif [ -z "$next" ] || [ $((H5SERVE_KEEP_S - idle)) -lt "$next" ]; then
            next=$((H5SERVE_KEEP_S - idle))
        fi
    done
    [ -z "$next" ] || echo "$next"
}

shm_free() {
    df -B1 --output=avail -- "${H5SERVE_SHM_DIR:-/dev/shm}" 2>/dev/null | tail -n 1 | tr -d ' '
}

release_for() {
    # A job of uid $1 needs $2 bytes of /dev/shm: stop idle kept daemons of other users, the
    # longest idle first, until that much is free. Lock held.
    local uid=$1 need=$2 free state other idle list=""
    free=$(shm_free) || return 0
    [ "${free:-0}" -lt "$need" ] || return 0
    for state in "$KEEP_ROOT"/*; do
        other=${state##*/}
        case "$other" in "" | *[!0-9]* | "$uid") continue ;; esac
        idle=$(idle_for "$other") || continue
        list+="$idle $other"$'\n'
    done
    while read -r idle other; do
        [ -n "$other" ] || continue
        free=$(shm_free) || return 0
        [ "${free:-0}" -lt "$need" ] || return 0
        log "releasing the idle kept daemon of uid $other (no job for ${idle}s) for a job of uid $uid: ${free} bytes free in ${H5SERVE_SHM_DIR:-/dev/shm}, ${need} wanted"
        stop_kept "$other"
    done < <(printf %s "$list" | sort -rn)
}

arm_timer() {
    # One detached timer per node (`epilog.sh --timer`): it holds $KEEP_ROOT/timer.lock while it
    # waits, so a second one exits at once; it lets go of it under the keep lock when nothing is
    # left to wait for, so an idle-since written after that arms a new one.
    setsid -f "$BASH" "$SELF" --timer </dev/null >/dev/null 2>&1 || log "cannot arm the keep timer"
}

timer() {
    local next
    exec 8>>"$KEEP_ROOT/timer.lock" || return 1
    flock -n 8 || return 0
    while true; do
        load_config  # the admin may have changed H5SERVE_KEEP_S since the timer was armed
        keep_lock || return 1
        next=$(reap_expired)
        if [ -z "$next" ]; then
            exec 8>&-
            keep_unlock
            return 0
        fi
        keep_unlock
        [ "$next" -lt 30 ] || next=29  # wakes at least every 30 s to re-read the config
        sleep "$((next + 1))"
    done
}

job_end_kept() {
    # The job's epilog with a kept daemon: unregister the job; the user's last job on the node
    # starts the idle clock (and the timer). Reaps what expired meanwhile. Lock held.
    local uid=$SLURM_JOB_UID
    rm -f -- "$KEEP_ROOT/$uid/jobs/$1"
    if [ -z "$(ls -A -- "$KEEP_ROOT/$uid/jobs" 2>/dev/null)" ]; then
        date +%s > "$KEEP_ROOT/$uid/idle-since"
        log "last job of uid $uid on this node ended; its daemon stays ${H5SERVE_KEEP_S}s"
    fi
    reap_expired >/dev/null
}

main() {
    load_config
    case "${1:-}" in
        --timer)
            [ -d "$KEEP_ROOT" ] || return 0
            timer
            return
            ;;
        --reap | --release)
            # From the prolog (before it takes the lock itself): expired daemons, and with
            # --release UID BYTES idle daemons of other users while /dev/shm has less free.
            [ -d "$KEEP_ROOT" ] || return 0
            keep_lock || return 1
            reap_expired >/dev/null
            if [ "$1" = --release ]; then
                case "${2:-}${3:-}" in "" | *[!0-9]*) ;; *) release_for "$2" "$3" ;; esac
            fi
            keep_unlock
            return 0
            ;;
    esac
    local job=${SLURM_JOB_ID:-}
    case "$job" in
        "" | *[!0-9]*) log "SLURM_JOB_ID='$job' is not a job id; is this running as a slurmd Epilog?"; return 1 ;;
    esac
    local dir=$RUN_ROOT/$job

    if [ -d "$KEEP_ROOT" ] && [ ! -L "$KEEP_ROOT" ]; then
        case "${SLURM_JOB_UID:-}" in "" | *[!0-9]*) ;; *)
            if keep_lock; then
                if [ -e "$KEEP_ROOT/$SLURM_JOB_UID/jobs/$job" ]; then
                    job_end_kept "$job"
                else
                    reap_expired >/dev/null
                fi
                keep_unlock
                [ -z "$(ls -A -- "$KEEP_ROOT" 2>/dev/null | grep -v '^timer.lock$')" ] || arm_timer
            fi
            ;;
        esac
    fi

    # A systemd instance (H5SERVE_LAUNCH=systemd, or started by hand): stopping it sends
    # SIGTERM and its ExecStopPost removes the dir and env file. Harmless when not loaded.
    if command -v systemctl >/dev/null 2>&1 && timeout 10 systemctl is-active --quiet "h5serve@$job.service" 2>/dev/null; then
        timeout 60 systemctl stop "h5serve@$job.service" || log "systemctl stop h5serve@$job.service failed"
    fi

    if [ -d "$dir" ] && [ ! -L "$dir" ]; then
        job_identity || return 1
        if ! stop_daemon "$dir"; then
            log "daemon on $dir cannot be stopped; leaving $dir and its segments"
            return 1
        fi
        remove_leftover_segments "$dir"
        remove_runtime_dir "$dir"
    fi
    rm -f -- "$ENV_ROOT/$job.env" "$ENV_ROOT/$job.env".*
    return 0
}

( main "$@" ) || log "cleanup incomplete (exit $?); see the lines above"
exit 0

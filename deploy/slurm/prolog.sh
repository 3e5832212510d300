#!/bin/bash
# h5serve SLURM node prolog: start a daemon for the job, as the job's user, on each node.
#
# slurm.conf (every node):
#   Prolog=/etc/slurm/h5serve/prolog.sh
#   Epilog=/etc/slurm/h5serve/epilog.sh
#   TaskProlog=/etc/slurm/h5serve/task_prolog.sh
#   PrologFlags=Alloc     # run the prolog on every node at allocation, before the batch
#                         # script, instead of at each node's first step
# If you already have a Prolog/Epilog, call these scripts from it (or use Prolog= with a
# directory of scripts, e.g. /etc/slurm/prolog.d/*, on Slurm versions that allow globs).
#
# Opt-in, per job: the daemon starts only for jobs whose comment contains the word h5serve,
#   sbatch --comment=h5serve train.sbatch         (or: #SBATCH --comment="h5serve")
# which slurmd passes to this script as SLURM_JOB_COMMENT. Site-wide: H5SERVE_ALL_JOBS=yes
# in /etc/default/h5serve-slurm starts one for every job. (Slurm 22.05 (tested: 22.05.8) and
# later pass SLURM_JOB_COMMENT to the node prolog; for another release check with
# `env > /tmp/prolog.env` in a test prolog, and where it is missing use H5SERVE_ALL_JOBS=yes.)
#
# What it does: creates the job's runtime dir /run/h5serve/$SLURM_JOB_ID (0700, owned by the
# job user, in root's /run/h5serve), then runs
#   h5serve start --user "$SLURM_JOB_USER" --runtime-dir /run/h5serve/$SLURM_JOB_ID
# The daemon drops to the job user before it creates anything, so the socket, pidfile and
# segments belong to that user and no other user can read them. The TaskProlog then exports
# H5SERVE_RUNTIME_DIR=/run/h5serve/$SLURM_JOB_ID to every task; the epilog stops the daemon
# (unlinking its segments) and removes the dir.
#
# Root only ever writes in directories no user can write to (/run/h5serve, its .holds and .root,
# /run/h5serve-jobs: checked to be real directories of root's, not symlinks), takes its lock
# only in the 0700 .root (no user can open it) and for at most LOCK_WAIT_S, and every step
# has a timeout. With H5SERVE_KEEP_S, see start_kept and docs/operations.md (kept daemons).
#
# Fail open: any failure is logged (logger -t h5serve, i.e. syslog/journal) and the script
# still exits 0. A failing prolog makes Slurm drain the node and requeue the job; without the
# daemon the job's ranks just read lazily through h5py.
#
# Idempotent: running it twice for a job leaves one daemon (h5serve start returns 0 when a
# daemon already answers on the runtime dir).
#
# Not with job_container/tmpfs: that plugin gives each job a private /dev/shm, which a
# daemon started here (outside the job's namespace) cannot see. Start the daemon inside the
# job instead (sbatch_example.sh), or keep /dev/shm out of the plugin's Dirs= where your
# Slurm version supports that.
#
# Settings, all optional, in /etc/default/h5serve-slurm (sourced as root, so ignored unless it
# is a regular file owned by root and writable by nobody else):
#   H5SERVE_BIN=/opt/h5serve/bin/h5serve   # the command; its interpreter must be runnable by
#                                          # job users (a venv under /opt, not /root)
#   H5SERVE_OPTS="--max-memory 64G --allow-root /datasets"   # extra `h5serve start` flags
#   H5SERVE_ALL_JOBS=yes                   # every job, not only those that opt in
#   H5SERVE_LAUNCH=systemd                 # systemctl start h5serve@$SLURM_JOB_ID instead
#                                          # (deploy/systemd/h5serve@.service): own cgroup,
#                                          # journald logs, watchdog
#   H5SERVE_START_TIMEOUT=90               # seconds before giving up on a start
#   H5SERVE_KEEP_S=600                     # keep one daemon per user per node, runtime dir
#                                          # /run/h5serve/user-<uid>, started with --idle-exit 600:
#                                          # it exits once unused that long with no job of its
#                                          # user here (docs/operations.md); 0 (default): one per job
#   H5SERVE_LOG=/var/log/h5serve-slurm.log # also append log lines here (no syslog on the node)

set -euo pipefail
cd /

# Slurm runs prologs without a search path.
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
CONFIG=${H5SERVE_SLURM_CONFIG:-/etc/default/h5serve-slurm}
RUN_ROOT=/run/h5serve          # h5serve@.service uses the same path
ENV_ROOT=/run/h5serve-jobs     # per-job environment files for h5serve@.service
ROOT_STATE=$RUN_ROOT/.root     # 0700, root's: root's lock (no user can open it)
HOLDS=$RUN_ROOT/.holds         # 0755, root's: <uid>/<job id>, one per running job on a kept daemon
LOCK_WAIT_S=60                 # at most this long for root's lock (epilog.sh holds it as long at most)
EPILOG=$(dirname -- "$(readlink -f -- "$0")")/epilog.sh   # installed next to this script

log() {
    local line="prolog job ${SLURM_JOB_ID:-?} on ${SLURMD_NODENAME:-$(hostname)}: $*"
    logger -t h5serve -- "$line" 2>/dev/null || true
    # H5SERVE_LOG (site config): also append to this root-owned file (nodes without syslog)
    [ -z "${H5SERVE_LOG:-}" ] || printf '%s h5serve: %s\n' "$(date '+%F %T')" "$line" >> "$H5SERVE_LOG" 2>/dev/null || true
}

root_only_writable() {
    # $1 is a regular file of root's that only root can write (the config, the epilog: run as root).
    local perms
    [ -f "$1" ] && [ ! -L "$1" ] || return 1
    perms=$(stat -c '%u %a' -- "$1" 2>/dev/null) || return 1
    case "$perms" in "0 "*[0-7][0145][0145]) return 0 ;; esac
    return 1
}

root_dir() {
    # Create $1 (mode $2, root's) if needed and check it is a real directory of root's with
    # that mode: root writes in it, so no user may plant anything there.
    local perms
    [ ! -L "$1" ] || { log "$1 is a symbolic link; refusing to use it"; return 1; }
    timeout 10 install -d -m "$2" -o root -g root "$1" || { log "cannot create $1"; return 1; }
    perms=$(stat -c '%F %u %a' -- "$1" 2>/dev/null) || perms="?"
    [ "$perms" = "directory 0 ${2#0}" ] || { log "$1 is not a root-owned directory with mode $2 ($perms); refusing to use it"; return 1; }
}

job_dir() {
    # The runtime dir $1, 0700, owned by uid $2 / gid $3: created here by root in root's
    # $RUN_ROOT, or left by an earlier run (then it must already be that user's real directory).
    local dir=$1 uid=$2 gid=$3 perms
    if mkdir -m 0700 -- "$dir" 2>/dev/null; then
        chown -h -- "$uid:$gid" "$dir" || { log "cannot give $dir to uid $uid"; rmdir -- "$dir"; return 1; }
        return 0
    fi
    perms=$(stat -c '%F %u' -- "$dir" 2>/dev/null) || perms="?"
    [ "$perms" = "directory $uid" ] || { log "$dir exists and is not a directory of uid $uid ($perms); refusing to use it"; return 1; }
}

write_env_file() {
    # $ENV_ROOT/$1.env for h5serve@$1.service, written to a fresh temporary (mktemp: O_EXCL)
    # and renamed, so systemd never reads half a file.
    local envfile=$ENV_ROOT/$1.env tmp
    tmp=$(mktemp "$envfile.XXXXXX") || return 1
    if printf 'H5SERVE_USER=%s\nH5SERVE_OPTS=%s\n' "$2" "$H5SERVE_OPTS" > "$tmp" && chmod 0644 "$tmp" \
        && mv -f -T -- "$tmp" "$envfile"; then
        return 0
    fi
    rm -f -- "$tmp"
    return 1
}

shm_need() {
    # Bytes of /dev/shm a new daemon started with options "$@" will use: its --max-memory
    # (64G, 48M, 512MiB: binary). Without one the daemon takes 80% of what is free when it
    # starts (h5serve/daemon/config.py, DEFAULT_MEMORY_FRACTION), which is there: 0.
    local prev="" word size=""
    for word in "$@"; do
        case "$word" in --max-memory=*) size=${word#*=} ;; esac
        [ "$prev" != --max-memory ] || size=$word
        prev=$word
    done
    [ -n "$size" ] || { echo 0; return; }
    size=${size%[Bb]}
    size=${size%i}
    timeout 10 numfmt --from=iec -- "$size" 2>/dev/null || { log "cannot read --max-memory $size; making no room"; echo 0; }
}

start_daemon() {
    # h5serve start as root for user $1 on runtime dir $2 with options "${@:3}": it drops to the
    # user and starts the daemon in its own session. Once more if the first try failed (a kept
    # daemon may have been exiting, idle, just as it was found).
    local user=$1 dir=$2 out try
    shift 2
    for try in 1 2; do
        if out=$(timeout -k 5 "$H5SERVE_START_TIMEOUT" "$H5SERVE_BIN" start --user "$user" --runtime-dir "$dir" \
            "$@" 2>&1); then
            echo "$out"
            return 0
        fi
        log "h5serve start failed (try $try): ${out//$'\n'/ | }"
    done
    return 1
}

start_kept() {
    # H5SERVE_KEEP_S > 0: the user's daemon on this node, /run/h5serve/user-<uid>, started with
    # --idle-exit KEEP_S (it exits on its own) or reused. The job's hold, $HOLDS/<uid>/<job>,
    # keeps it while the job runs (--hold-dir): registered under root's lock, which epilog.sh
    # --make-room also takes before it stops an idle daemon, so it never stops one a job holds.
    # False (the caller starts a per-job daemon) unless the hold was written.
    local user=$1 uid=$2 gid=$3 dir=$RUN_ROOT/user-$2 hold=$HOLDS/$2/$SLURM_JOB_ID need out
    shift 3
    root_dir "$ROOT_STATE" 0700 && root_dir "$HOLDS" 0755 && root_dir "$HOLDS/$uid" 0755 || return 1
    exec 9>>"$ROOT_STATE/lock" || { log "cannot open $ROOT_STATE/lock"; return 1; }
    flock -w "$LOCK_WAIT_S" 9 || { exec 9>&-; log "waited ${LOCK_WAIT_S}s for $ROOT_STATE/lock"; return 1; }
    if ! { : > "$hold" && [ -f "$hold" ]; } 2>/dev/null; then
        exec 9>&-
        rm -f -- "$hold"
        log "cannot register the job in $hold (/run full?)"
        return 1
    fi
    exec 9>&-
    need=$(shm_need "$@")
    if [ "$need" -gt 0 ] && [ ! -S "$dir/h5serve.sock" ]; then  # a new daemon: room for it
        if root_only_writable "$EPILOG"; then
            H5SERVE_SLURM_CONFIG=$CONFIG timeout -k 5 600 "$EPILOG" --make-room "$uid" "$need" \
                || log "making room failed"
        else
            log "$EPILOG is not root's and writable by root only; no room made for the job"
        fi
    fi
    if job_dir "$dir" "$uid" "$gid" \
        && out=$(start_daemon "$user" "$dir" "$@" --idle-exit "$H5SERVE_KEEP_S" --hold-dir "$HOLDS/$uid"); then
        case "$out" in
            *"already running"*) log "reusing the kept daemon for $user on $dir" ;;
            *) log "kept daemon for $user on $dir (exits once unused for ${H5SERVE_KEEP_S}s with no job of $user here)" ;;
        esac
        return 0
    fi
    rm -f -- "$hold"
    return 1
}

opted_in() {
    case "${H5SERVE_ALL_JOBS:-no}" in yes | true | 1) return 0 ;; esac
    # The word h5serve anywhere in the comment, separated by spaces, commas or semicolons.
    local words=" ${SLURM_JOB_COMMENT:-} "
    words=${words//[,;]/ }
    case "$words" in *" h5serve "*) return 0 ;; esac
    return 1
}

main() {
    H5SERVE_BIN=h5serve
    H5SERVE_OPTS=""
    H5SERVE_ALL_JOBS=no
    H5SERVE_LAUNCH=direct
    H5SERVE_START_TIMEOUT=90
    H5SERVE_KEEP_S=0
    if [ -e "$CONFIG" ]; then
        root_only_writable "$CONFIG" || { log "$CONFIG is not a regular file that only root can write; refusing to source it"; return 1; }
        # shellcheck source=/dev/null
        . "$CONFIG" || { log "cannot read $CONFIG"; return 1; }
    fi
    opted_in || return 0

    local job=${SLURM_JOB_ID:-} user=${SLURM_JOB_USER:-} uid gid
    case "$job" in
        "" | *[!0-9]*) log "SLURM_JOB_ID='$job' is not a job id; is this running as a slurmd Prolog?"; return 1 ;;
    esac
    case "$user" in
        "" | root | -* | *[!A-Za-z0-9._@-]*) log "SLURM_JOB_USER='$user': no daemon for root or an unknown user"; return 0 ;;
    esac
    if ! uid=$(timeout 10 id -u -- "$user" 2>/dev/null) || ! gid=$(timeout 10 id -g -- "$user" 2>/dev/null); then
        log "no such user '$user'"
        return 1
    fi
    if [ "$uid" = 0 ]; then
        log "SLURM_JOB_USER='$user' has uid 0: no daemon for root"
        return 0
    fi
    local dir=$RUN_ROOT/$job opts=()
    read -r -a opts <<< "$H5SERVE_OPTS"
    root_dir "$RUN_ROOT" 0755 || return 1
    case "$H5SERVE_KEEP_S" in "" | *[!0-9]*) log "H5SERVE_KEEP_S='$H5SERVE_KEEP_S' is not a number of seconds; 0"; H5SERVE_KEEP_S=0 ;; esac
    if [ "$H5SERVE_KEEP_S" -gt 0 ]; then
        if [ "$H5SERVE_LAUNCH" = direct ]; then
            start_kept "$user" "$uid" "$gid" ${opts[@]+"${opts[@]}"} && return 0
            log "no kept daemon for this job; starting one for this job only"
        else
            log "H5SERVE_KEEP_S needs H5SERVE_LAUNCH=direct; starting a daemon for this job only"
        fi
    fi

    case "$H5SERVE_LAUNCH" in
        systemd)
            root_dir "$ENV_ROOT" 0755 || return 1
            write_env_file "$job" "$user" || { log "cannot write $ENV_ROOT/$job.env"; return 1; }
            if ! timeout -k 5 "$H5SERVE_START_TIMEOUT" systemctl start "h5serve@$job.service"; then
                log "systemctl start h5serve@$job.service failed; see journalctl -u h5serve@$job"
                return 1
            fi
            ;;
        direct)
            job_dir "$dir" "$uid" "$gid" || return 1
            start_daemon "$user" "$dir" ${opts[@]+"${opts[@]}"} >/dev/null || return 1
            ;;
        *)
            log "H5SERVE_LAUNCH='$H5SERVE_LAUNCH' must be direct or systemd"
            return 1
            ;;
    esac
    log "daemon for $user on $dir ($H5SERVE_LAUNCH)"
}

# A subshell, so that even `set -u` tripping on a typo cannot make the prolog fail.
( main ) || log "h5serve not started (exit $?); the job runs without it"
exit 0

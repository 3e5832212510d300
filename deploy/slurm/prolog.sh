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
# Root only ever writes in directories no user can write to (/run/h5serve, /run/h5serve-jobs:
# checked to be real directories of root's, not symlinks), and every step has a timeout.
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
#                                          # /run/h5serve/user-<uid>, until the user has had no
#                                          # job here for that long (epilog.sh: "kept daemons";
#                                          # docs/operations.md); 0 (default): one per job
#   H5SERVE_LOG=/var/log/h5serve-slurm.log # also append log lines here (no syslog on the node)

set -u
cd / || exit 0

# Slurm runs prologs without a search path.
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
CONFIG=${H5SERVE_SLURM_CONFIG:-/etc/default/h5serve-slurm}
RUN_ROOT=/run/h5serve          # h5serve@.service uses the same path
ENV_ROOT=/run/h5serve-jobs     # per-job environment files for h5serve@.service
KEEP_ROOT=$RUN_ROOT/.keep      # H5SERVE_KEEP_S: root's bookkeeping of kept daemons (epilog.sh)
KEEP_LOCK=$RUN_ROOT/.keep.lock
EPILOG=$(dirname -- "$(readlink -f -- "$0")")/epilog.sh   # installed next to this script

log() {
    local line="prolog job ${SLURM_JOB_ID:-?} on ${SLURMD_NODENAME:-$(hostname)}: $*"
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

root_dir() {
    # Create $1 (mode 0755, root's) if needed and check it is a real directory of root's that
    # nobody else can write to: root writes in it, so no user may plant anything there.
    if [ -L "$1" ]; then
        log "$1 is a symbolic link; refusing to use it"
        return 1
    fi
    timeout 10 install -d -m 0755 -o root -g root "$1" || { log "cannot create $1"; return 1; }
    local perms
    perms=$(stat -c '%F %u %a' -- "$1" 2>/dev/null)
    if [ "$perms" != "directory 0 755" ]; then
        log "$1 is not a root-owned directory with mode 755 ($perms); refusing to use it"
        return 1
    fi
}

job_dir() {
    # The job's runtime dir $1, 0700, owned by uid $2 / gid $3: created here by root in root's
    # $RUN_ROOT (no user can have put anything at the name), or left by an earlier run of this
    # prolog for the same job (then it must already be that user's real directory).
    local dir=$1 uid=$2 gid=$3 perms
    if mkdir -m 0700 -- "$dir" 2>/dev/null; then
        chown -h -- "$uid:$gid" "$dir" || { log "cannot give $dir to uid $uid"; rmdir -- "$dir"; return 1; }
        return 0
    fi
    perms=$(stat -c '%F %u' -- "$dir" 2>/dev/null)
    if [ "$perms" != "directory $uid" ]; then
        log "$dir exists and is not a directory of uid $uid ($perms); refusing to use it"
        return 1
    fi
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

to_bytes() {
    # 64G, 48M, 512MiB, 1.5GB, 1000000 -> bytes (h5serve's sizes are binary); nothing if unreadable.
    local v=${1%B}
    v=${v%i}
    timeout 10 numfmt --from=iec -- "$v" 2>/dev/null
}

shm_need() {
    # What a new job may need in /dev/shm: the daemon's --max-memory from H5SERVE_OPTS, else
    # the whole of /dev/shm.
    local prev="" word bytes
    for word in "$@"; do
        case "$word" in --max-memory=*) bytes=$(to_bytes "${word#*=}") && { echo "$bytes"; return; } ;; esac
        if [ "$prev" = --max-memory ]; then bytes=$(to_bytes "$word") && { echo "$bytes"; return; }; fi
        prev=$word
    done
    df -B1 --output=size -- "${H5SERVE_SHM_DIR:-/dev/shm}" 2>/dev/null | tail -n 1 | tr -d ' '
}

epilog_trusted() {
    # The prolog runs the epilog (reaping, releasing) as root: root's, writable by root only.
    local perms
    [ -f "$EPILOG" ] && [ ! -L "$EPILOG" ] || return 1
    perms=$(stat -c '%u %a' -- "$EPILOG" 2>/dev/null) || return 1
    case "$perms" in "0 "*[0-7][0145][0145]) return 0 ;; esac
    log "$EPILOG is not root's and writable by root only; kept daemons are not reaped from the prolog"
    return 1
}

start_kept() {
    # H5SERVE_KEEP_S > 0: the user's daemon on this node, /run/h5serve/user-<uid>, started or
    # reused, with this job registered in root's bookkeeping (epilog.sh: "kept daemons"), all
    # under the keep lock, so the user's last epilog cannot stop it between our check and the
    # job's start. First: expired kept daemons are stopped, and idle ones of other users give
    # their /dev/shm back while less than this job may need is free.
    local user=$1 uid=$2 gid=$3 dir=$RUN_ROOT/user-$2 out need
    shift 3
    if [ -L "$KEEP_ROOT" ]; then log "$KEEP_ROOT is a symbolic link; refusing to use it"; return 1; fi
    timeout 10 install -d -m 0700 -o root -g root "$KEEP_ROOT" || { log "cannot create $KEEP_ROOT"; return 1; }
    need=$(shm_need "$@")
    if epilog_trusted; then
        H5SERVE_SLURM_CONFIG=$CONFIG timeout -k 5 300 "$EPILOG" --release "$uid" "${need:-0}" \
            || log "reaping kept daemons failed"
    fi
    exec 9>>"$KEEP_LOCK" || { log "cannot open $KEEP_LOCK"; return 1; }
    flock -w 120 9 || { log "waited 120 s for $KEEP_LOCK; giving up"; return 1; }
    timeout 10 install -d -m 0700 -o root -g root "$KEEP_ROOT/$uid" "$KEEP_ROOT/$uid/jobs" \
        || { log "cannot create $KEEP_ROOT/$uid"; return 1; }
    : > "$KEEP_ROOT/$uid/jobs/$SLURM_JOB_ID"
    rm -f -- "$KEEP_ROOT/$uid/idle-since"
    job_dir "$dir" "$uid" "$gid" || return 1
    if ! out=$(timeout -k 5 "$H5SERVE_START_TIMEOUT" "$H5SERVE_BIN" start --user "$user" --runtime-dir "$dir" \
        "$@" 2>&1); then
        log "h5serve start failed: ${out//$'\n'/ | }"
        return 1
    fi
    case "$out" in
        *"already serves"* | *"already running"*) log "reusing the kept daemon for $user on $dir" ;;
        *) log "kept daemon for $user on $dir (stays ${H5SERVE_KEEP_S}s after the user's last job here)" ;;
    esac
    exec 9>&-
}

opted_in() {
    case "${H5SERVE_ALL_JOBS:-no}" in
        yes | true | 1) return 0 ;;
    esac
    # The word h5serve anywhere in the comment, separated by spaces, commas or semicolons.
    local words=" ${SLURM_JOB_COMMENT:-} "
    words=${words//[,;]/ }
    case "$words" in
        *" h5serve "*) return 0 ;;
    esac
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
        if ! config_trusted "$CONFIG"; then
            log "$CONFIG is not a regular file that only root can write; refusing to source it"
            return 1
        fi
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
    root_dir "$RUN_ROOT" || return 1
    case "$H5SERVE_KEEP_S" in "" | *[!0-9]*) log "H5SERVE_KEEP_S='$H5SERVE_KEEP_S' is not a number of seconds; 0"; H5SERVE_KEEP_S=0 ;; esac
    if [ "$H5SERVE_KEEP_S" -gt 0 ]; then
        if [ "$H5SERVE_LAUNCH" = direct ]; then
            start_kept "$user" "$uid" "$gid" ${opts[@]+"${opts[@]}"}
            return
        fi
        log "H5SERVE_KEEP_S needs H5SERVE_LAUNCH=direct; starting a daemon for this job only"
    fi

    case "$H5SERVE_LAUNCH" in
        systemd)
            root_dir "$ENV_ROOT" || return 1
            write_env_file "$job" "$user" || { log "cannot write $ENV_ROOT/$job.env"; return 1; }
            if ! timeout -k 5 "$H5SERVE_START_TIMEOUT" systemctl start "h5serve@$job.service"; then
                log "systemctl start h5serve@$job.service failed; see journalctl -u h5serve@$job"
                return 1
            fi
            ;;
        direct)
            job_dir "$dir" "$uid" "$gid" || return 1
            local out
            if ! out=$(timeout -k 5 "$H5SERVE_START_TIMEOUT" "$H5SERVE_BIN" start --user "$user" --runtime-dir "$dir" \
                ${opts[@]+"${opts[@]}"} 2>&1); then
                log "h5serve start failed: ${out//$'\n'/ | }"
                return 1
            fi
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

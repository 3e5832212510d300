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
# in /etc/default/h5serve-slurm starts one for every job. (Older Slurm releases do not pass
# SLURM_JOB_COMMENT to the node prolog; check with `env > /tmp/prolog.env` in a test prolog,
# and use H5SERVE_ALL_JOBS=yes there.)
#
# What it does: h5serve start --user "$SLURM_JOB_USER" --runtime-dir /run/h5serve/$SLURM_JOB_ID
# The daemon drops to the job user before it creates anything, so the runtime dir, socket and
# segments belong to that user and no other user can read them. The TaskProlog then exports
# H5SERVE_RUNTIME_DIR=/run/h5serve/$SLURM_JOB_ID to every task; the epilog stops the daemon
# (unlinking its segments) and removes the dir.
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
# Settings, all optional, in /etc/default/h5serve-slurm (sourced; must be owned by root):
#   H5SERVE_BIN=/opt/h5serve/bin/h5serve   # the command; its interpreter must be runnable by
#                                          # job users (a venv under /opt, not /root)
#   H5SERVE_OPTS="--max-memory 64G --allow-root /datasets"   # extra `h5serve start` flags
#   H5SERVE_ALL_JOBS=yes                   # every job, not only those that opt in
#   H5SERVE_LAUNCH=systemd                 # systemctl start h5serve@$SLURM_JOB_ID instead
#                                          # (deploy/systemd/h5serve@.service): own cgroup,
#                                          # journald logs, watchdog
#   H5SERVE_START_TIMEOUT=90               # seconds before giving up on a start

set -u

# Slurm runs prologs without a search path.
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
CONFIG=${H5SERVE_SLURM_CONFIG:-/etc/default/h5serve-slurm}
RUN_ROOT=/run/h5serve          # h5serve@.service uses the same path
ENV_ROOT=/run/h5serve-jobs     # per-job environment files for h5serve@.service

log() {
    logger -t h5serve -- "prolog job ${SLURM_JOB_ID:-?} on ${SLURMD_NODENAME:-$(hostname)}: $*" 2>/dev/null || true
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
    if [ -e "$CONFIG" ]; then
        # shellcheck source=/dev/null
        . "$CONFIG" || { log "cannot read $CONFIG"; return 1; }
    fi
    opted_in || return 0

    local job=${SLURM_JOB_ID:-} user=${SLURM_JOB_USER:-}
    case "$job" in
        "" | *[!0-9]*) log "SLURM_JOB_ID='$job' is not a job id; is this running as a slurmd Prolog?"; return 1 ;;
    esac
    if [ -z "$user" ] || [ "$user" = root ]; then
        log "SLURM_JOB_USER='$user': no daemon for root or an unknown user"
        return 0
    fi
    local dir=$RUN_ROOT/$job opts=()
    read -r -a opts <<< "$H5SERVE_OPTS"
    install -d -m 0755 -o root -g root "$RUN_ROOT" || { log "cannot create $RUN_ROOT"; return 1; }

    case "$H5SERVE_LAUNCH" in
        systemd)
            install -d -m 0755 -o root -g root "$ENV_ROOT" || { log "cannot create $ENV_ROOT"; return 1; }
            local envfile=$ENV_ROOT/$job.env
            # Written to a temporary name and renamed, so systemd never reads half a file.
            if ! { printf 'H5SERVE_USER=%s\nH5SERVE_OPTS=%s\n' "$user" "$H5SERVE_OPTS" > "$envfile.tmp" \
                    && mv -f "$envfile.tmp" "$envfile"; }; then
                log "cannot write $envfile"
                return 1
            fi
            if ! timeout "$H5SERVE_START_TIMEOUT" systemctl start "h5serve@$job.service"; then
                log "systemctl start h5serve@$job.service failed; see journalctl -u h5serve@$job"
                return 1
            fi
            ;;
        direct)
            local out
            if ! out=$(timeout "$H5SERVE_START_TIMEOUT" "$H5SERVE_BIN" start --user "$user" --runtime-dir "$dir" \
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

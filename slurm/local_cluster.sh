#!/usr/bin/env bash
# A real single-node SLURM cluster (munged, slurmctld, slurmd, slurmdbd + MariaDB so `sacct` works) for the
# tests and for trying the sweeps on a laptop. Debian/Ubuntu packages, daemons started by hand (no systemd).
#
#   bash slurm/local_cluster.sh start    # installs the packages with apt-get if missing (~40 s), else ~3 s
#   bash slurm/local_cluster.sh status   # each daemon (ours / not ours / stopped) and the node state; rc 0 if up
#   bash slurm/local_cluster.sh stop     # cancels all jobs, stops only the daemons this script started
#
# Environment: SLURM_LOCAL_CPUS=N  advertise N CPUs (default: the machine's), so N one-CPU jobs run at once;
#              SLURM_LOCAL_ACCOUNTING=0  no slurmdbd/MariaDB (then sacct fails and submitit cannot see
#              cancelled jobs: tests need accounting).
# Needs root. Refuses to touch an /etc/slurm/slurm.conf it did not write. Facts and pitfalls behind each step:
# docs/cluster.md, "Local SLURM" (pid files survive on /run, zombies linger, policy-rc.d, clustername in the state).
set -euo pipefail
export PATH="/usr/local/sbin:/usr/sbin:/sbin:/usr/local/bin:/usr/bin:/bin:${PATH:-}"

STATE_DIR=/run/slurm-local          # our pid records: "pid starttime" per daemon
CONF=/etc/slurm/slurm.conf
DBD_CONF=/etc/slurm/slurmdbd.conf
LOG_DIR=/var/log/slurm
MARK="# managed by slurm/local_cluster.sh (single node, for tests)"
ACCOUNTING=${SLURM_LOCAL_ACCOUNTING:-1}
CPUS=${SLURM_LOCAL_CPUS:-}
HOST=$(hostname -s)

if [ "$ACCOUNTING" = 1 ]; then
  DAEMONS=(munged mariadbd slurmdbd slurmctld slurmd)
else
  DAEMONS=(munged slurmctld slurmd)
fi

log() { echo "local_cluster: $*" >&2; }
die() { log "error: $*"; exit 1; }

# ------------------------------------------------------------------ process bookkeeping
# A pid is trusted only if the process is alive, not a zombie, has the expected comm and, for our records,
# the recorded start time (pids are reused, and /run is not a tmpfs here, so records outlive reboots).
proc_ok() {  # proc_ok PID COMM [STARTTIME]
  local pid=$1 comm=$2 start=${3:-} stat
  [ -r "/proc/$pid/stat" ] || return 1
  stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$comm" ] || return 1
  stat=${stat##*) }                        # fields after "pid (comm) "
  set -- $stat                             # $1 = state, $20 = starttime
  [ "$1" != Z ] || return 1
  [ -z "$start" ] || [ "${20}" = "$start" ]
}

starttime() { local s; s=$(cat "/proc/$1/stat"); s=${s##*) }; set -- $s; echo "${20}"; }

ours() {  # ours NAME -> pid on stdout if the recorded process is alive
  local rec="$STATE_DIR/$1.pid" pid start
  [ -f "$rec" ] || return 1
  read -r pid start <"$rec" || return 1
  proc_ok "$pid" "$1" "$start" && echo "$pid"
}

foreign() {  # foreign NAME -> pid of a live process with that comm that we did not start
  local p
  for p in /proc/[0-9]*; do
    p=${p#/proc/}
    if proc_ok "$p" "$1"; then echo "$p"; return 0; fi
  done
  return 1
}

record() {  # record NAME PID
  mkdir -p "$STATE_DIR"
  echo "$2 $(starttime "$2")" >"$STATE_DIR/$1.pid"
}

wait_for() {  # wait_for SECONDS DESCRIPTION CMD...
  local t=$1 what=$2 i; shift 2
  for ((i = 0; i < t * 10; i++)); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.1
  done
  die "$what not ready after ${t}s (logs: $LOG_DIR)"
}

pid_from_file() {  # pid_from_file FILE COMM SECONDS -> waits for a daemon to write its pid file
  local i pid
  for ((i = 0; i < $3 * 10; i++)); do
    if [ -s "$1" ]; then
      read -r pid <"$1" || true
      if [ -n "${pid:-}" ] && proc_ok "$pid" "$2"; then echo "$pid"; return 0; fi
    fi
    sleep 0.1
  done
  die "$2 did not start (pid file $1; logs: $LOG_DIR)"
}

# ------------------------------------------------------------------ install
install_packages() {
  local pkgs=(munge slurm-client slurmctld slurmd) missing=() p
  [ "$ACCOUNTING" = 1 ] && pkgs+=(slurmdbd mariadb-server)
  for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  command -v apt-get >/dev/null || die "packages missing (${missing[*]}) and no apt-get to install them"
  log "installing ${missing[*]} (apt-get, --no-install-recommends)"
  # No init system here: a policy-rc.d that denies keeps the packages' init scripts from starting daemons.
  local made_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && made_policy=1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  [ "$made_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
  return 0
}

# ------------------------------------------------------------------ config
write_if_changed() {  # write_if_changed FILE MODE < content ; returns 0 if it changed
  local tmp
  tmp=$(mktemp "$1.XXXXXX")
  cat >"$tmp"
  chmod "$2" "$tmp"
  if [ -f "$1" ] && cmp -s "$tmp" "$1"; then rm -f "$tmp"; return 1; fi
  mv -f "$tmp" "$1"
}

node_line() {
  local mem line
  line=$(slurmd -C | head -n1)                      # NodeName=vm CPUs=2 Boards=1 ... RealMemory=23000
  mem=${line##*RealMemory=}; mem=${mem%% *}
  mem=$((mem * 9 / 10))
  if [ -n "$CPUS" ]; then
    echo "NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$mem State=UNKNOWN"
  else
    # slurmd's own socket/core layout, so slurmctld does not "reconfigure socket/core boundaries"
    line=$(echo "$line" | sed -E "s/^NodeName=[^ ]+/NodeName=$HOST/; s/RealMemory=[0-9]+/RealMemory=$mem/")
    echo "$line NodeAddr=127.0.0.1 State=UNKNOWN"
  fi
}

write_configs() {  # returns 0 if slurm.conf or slurmdbd.conf changed
  mkdir -p /etc/slurm "$LOG_DIR" /var/spool/slurmctld /var/spool/slurmd
  if [ -f "$CONF" ] && ! head -n1 "$CONF" | grep -qF "$MARK"; then
    die "$CONF exists and was not written by this script; not touching a real SLURM setup"
  fi
  local storage=accounting_storage/none changed=1
  [ "$ACCOUNTING" = 1 ] && storage=accounting_storage/slurmdbd
  write_if_changed "$CONF" 644 <<EOF && changed=0
$MARK
ClusterName=local
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
CryptoType=crypto/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=$storage
AccountingStorageHost=localhost
AccountingStoragePort=6819
JobCompType=jobcomp/none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=5
Waittime=0
$([ -n "$CPUS" ] && echo "SlurmdParameters=config_overrides")
$(node_line)
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
  if [ "$ACCOUNTING" = 1 ]; then
    local pass=""
    [ -f "$DBD_CONF" ] && pass=$(sed -n 's/^StoragePass=//p' "$DBD_CONF")
    [ -n "$pass" ] || pass=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
    write_if_changed "$DBD_CONF" 600 <<EOF && changed=0
$MARK
AuthType=auth/munge
DbdHost=localhost
DbdPort=6819
SlurmUser=root
DebugLevel=info
LogFile=$LOG_DIR/slurmdbd.log
PidFile=/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StoragePort=3306
StorageUser=slurm
StoragePass=$pass
StorageLoc=slurm_acct_db
EOF
  fi
  # slurmctld refuses to start on state saved under another ClusterName: move that state aside
  local cn=/var/spool/slurmctld/clustername
  if [ -f "$cn" ] && [ "$(cat "$cn")" != local ]; then
    mv /var/spool/slurmctld "/var/spool/slurmctld.old-$(date +%Y%m%d%H%M%S)"
    mkdir -p /var/spool/slurmctld
  fi
  return $changed
}

# ------------------------------------------------------------------ daemons
start_munged() {
  [ -f /etc/munge/munge.key ] || mungekey -c
  install -d -o munge -g munge /run/munge
  runuser -u munge -- /usr/sbin/munged
  record munged "$(pid_from_file /run/munge/munged.pid munged 10)"
  wait_for 10 munge bash -c 'munge -n | unmunge'
}

start_mariadbd() {
  install -d -o mysql -g mysql /run/mysqld
  touch "$LOG_DIR/mariadb.err" && chown mysql:mysql "$LOG_DIR/mariadb.err"
  if [ ! -d /var/lib/mysql/mysql ]; then
    mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/dev/null
  fi
  setsid /usr/sbin/mariadbd --user=mysql --datadir=/var/lib/mysql --pid-file=/run/mysqld/mysqld.pid \
    --socket=/run/mysqld/mysqld.sock --skip-networking --innodb-buffer-pool-size=64M \
    --innodb-lock-wait-timeout=900 --log-error="$LOG_DIR/mariadb.err" </dev/null >/dev/null 2>&1 &
  record mariadbd "$(pid_from_file /run/mysqld/mysqld.pid mariadbd 30)"
  wait_for 30 MariaDB mariadb-admin --socket=/run/mysqld/mysqld.sock ping
}

grant_db() {
  local pass
  pass=$(sed -n 's/^StoragePass=//p' "$DBD_CONF")
  mariadb --socket=/run/mysqld/mysqld.sock -uroot -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$pass';
    ALTER USER 'slurm'@'localhost' IDENTIFIED BY '$pass'; GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
}

start_slurm_daemon() {  # start_slurm_daemon NAME PIDFILE
  rm -f "$2"
  "/usr/sbin/$1"
  record "$1" "$(pid_from_file "$2" "$1" 20)"
}

start_one() {
  case $1 in
    munged) start_munged ;;
    mariadbd) start_mariadbd; grant_db ;;
    slurmdbd) start_slurm_daemon slurmdbd /run/slurmdbd.pid
              wait_for 30 slurmdbd sacctmgr -n -i show cluster ;;
    slurmctld) start_slurm_daemon slurmctld /run/slurmctld.pid
               wait_for 30 slurmctld bash -c 'scontrol ping | grep -q "is UP"' ;;
    slurmd) start_slurm_daemon slurmd /run/slurmd.pid ;;
  esac
}

node_idle() {
  local s
  s=$(sinfo -h -N -n "$HOST" -o %T 2>/dev/null) || return 1
  case $s in idle|mixed|allocated) return 0 ;; *) return 1 ;; esac
}

stop_pid() {  # stop_pid NAME PID
  kill -TERM "$2" 2>/dev/null || true
  local i
  for ((i = 0; i < 100; i++)); do proc_ok "$2" "$1" || return 0; sleep 0.1; done
  log "$1 ($2) ignored SIGTERM for 10 s; SIGKILL"
  kill -KILL "$2" 2>/dev/null || true
}

cmd_stop() {
  local name pid i
  if pid=$(ours slurmctld); then scancel --full --quiet -u root 2>/dev/null || true; fi
  for ((i = ${#DAEMONS[@]} - 1; i >= 0; i--)); do
    name=${DAEMONS[i]}
    if pid=$(ours "$name"); then
      stop_pid "$name" "$pid"
      log "stopped $name ($pid)"
    elif pid=$(foreign "$name"); then
      log "$name ($pid) was not started by this script: left running"
    fi
    rm -f "$STATE_DIR/$name.pid"
  done
}

cmd_start() {
  [ "$(id -u)" = 0 ] || die "needs root (it installs packages, writes /etc/slurm and starts daemons)"
  install_packages
  if write_configs; then
    if ours slurmctld >/dev/null || ours slurmd >/dev/null; then
      log "config changed: restarting the daemons"
      cmd_stop
    fi
  fi
  local name pid
  for name in "${DAEMONS[@]}"; do
    if ours "$name" >/dev/null; then continue; fi
    if pid=$(foreign "$name"); then log "$name ($pid) already running, not started by this script: using it"; continue; fi
    start_one "$name"
  done
  # A node that went down (killed slurmd) stays DOWN until told otherwise; ReturnToService=2 handles most cases.
  if ! node_idle; then
    sleep 0.5
    node_idle || scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true
  fi
  wait_for 30 "node $HOST" node_idle
  log "up: partition debug, node $HOST ($(sinfo -h -N -n "$HOST" -o '%c CPUs, %T'))"
}

cmd_status() {
  local name pid up=0
  for name in "${DAEMONS[@]}"; do
    if pid=$(ours "$name"); then echo "$name: running ($pid, started by this script)"
    elif pid=$(foreign "$name"); then echo "$name: running ($pid, not started by this script)"
    else echo "$name: stopped"; up=3
    fi
  done
  if [ $up = 0 ] && node_idle; then
    echo "node $HOST: $(sinfo -h -N -n "$HOST" -o '%T, %c CPUs')"
  else
    echo "cluster: not ready"; up=3
  fi
  return $up
}

case ${1:-} in
  start) cmd_start ;;
  stop) [ "$(id -u)" = 0 ] || die "needs root"; cmd_stop ;;
  status) cmd_status ;;
  *) echo "usage: bash slurm/local_cluster.sh start|stop|status" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# Start (start DIR PORT) or stop (stop DIR) a throwaway PostgreSQL server on 127.0.0.1 for the
# fleet-mode tests. Installs Debian's postgresql package when no server binaries are found.
set -euo pipefail
cmd=$1; dir=$2
pgbin() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1; }
as_pg() { if [ "$(id -u)" = 0 ]; then su postgres -s /bin/bash -c "$*"; else bash -c "$*"; fi; }
case "$cmd" in
  start)
    port=$3
    if [ -z "$(pgbin)" ]; then
      (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql) >/dev/null
    fi
    bin=$(pgbin)
    mkdir -p "$dir"
    [ "$(id -u)" = 0 ] && chown postgres "$dir"
    as_pg "$bin/initdb -D '$dir/data' -A trust -U postgres >'$dir/initdb.log' 2>&1"
    as_pg "$bin/pg_ctl -D '$dir/data' -l '$dir/server.log' -w -o \"-p $port -k '$dir' -c listen_addresses=127.0.0.1 -c max_connections=200\" start >/dev/null"
    ;;
  stop)
    bin=$(pgbin)
    [ -d "$dir/data" ] && as_pg "$bin/pg_ctl -D '$dir/data' -m fast -w stop >/dev/null" || true
    rm -rf "$dir"
    ;;
esac

#!/usr/bin/env bash
# Keeps a background grid (started with `nice -n 19`) out of the way of foreground work.
# Linux groups processes by session (autogroup) and shares the CPU between groups before
# `nice` applies inside one; every ablation run starts its own session, so a nice-19 run
# still takes a whole core from a foreground job in another group. This loop sets the
# autogroup nice of every nice-19 process outside its own group to 19 (every 3 s).
#
#   nohup bash scripts/background_nice.sh >/dev/null 2>&1 &   # from the shell that started the grid
set -u
[ -r /proc/sys/kernel/sched_autogroup_enabled ] || { echo "no autogroups here"; exit 0; }
mine=$(cut -d' ' -f1 /proc/$$/autogroup)
while true; do
  for p in $(ps -eo pid=,ni= | awk '$2 == 19 {print $1}'); do
    g=$(cut -d' ' -f1 "/proc/$p/autogroup" 2>/dev/null) || continue
    [ -n "$g" ] && [ "$g" != "$mine" ] && echo 19 > "/proc/$p/autogroup" 2>/dev/null
  done
  sleep 3
done

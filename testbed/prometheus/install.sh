#!/usr/bin/env bash
# Makes sure Debian's prometheus package (promtool and prometheus) is here:
# `make test` checks the alert rules and every server's /metrics with
# promtool, and the prometheus scenarios scrape the testbed with prometheus.
# Installs it with apt-get when run as root on Debian/Ubuntu; otherwise says
# what to install and fails.
set -euo pipefail
if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "== installing Debian's prometheus package (promtool, prometheus)"
  # The package's service is not wanted here: policy-rc.d keeps apt from
  # starting it where there is an init system.
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  command -v promtool >/dev/null 2>&1 || { echo "prometheus installed but promtool is not on PATH" >&2; exit 1; }
else
  echo "promtool and prometheus are missing: install Debian's prometheus package (apt-get install prometheus)" >&2
  exit 1
fi

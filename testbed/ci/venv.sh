# Sourced by the scripts that keep a Python virtualenv under target/
# (testbed/k8s/pyenv.sh, components/kt-python/build.sh).
#
#   kt_venv NAME VENV REQUIREMENTS [CHECK]
#
# Creates VENV with the pinned packages of REQUIREMENTS once: again only when
# the requirements change (a stamp holds their hash). CHECK, a command, runs
# after the install and must succeed before the stamp is written. Quiet when
# up to date, loud on failure (messages start with NAME). Needs python3 with
# venv and pip (Debian: apt-get install -y python3-venv) and PyPI the first
# time only.
kt_venv() {
  local name=$1 venv=$2 req=$3 check=${4:-}
  local stamp=$venv/.kt-requirements want log
  want=$(sha256sum "$req" | cut -d' ' -f1)
  if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    return 0
  fi
  if ! command -v python3 >/dev/null 2>&1; then
    echo "$name: python3 not found (apt-get install -y python3 python3-venv)" >&2
    return 1
  fi
  echo "$name: creating $venv" >&2
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  if ! python3 -m venv "$venv" >&2; then
    echo "$name: python3 -m venv failed (Debian/Ubuntu: apt-get install -y python3-venv)" >&2
    return 1
  fi
  log=$(mktemp)
  if ! "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
      --no-input -r "$req" >"$log" 2>&1; then
    cat "$log" >&2; rm -f "$log"
    echo "$name: pip install -r $req failed" >&2
    return 1
  fi
  rm -f "$log"
  if [ -n "$check" ] && ! $check; then
    echo "$name: the new virtualenv $venv fails its check" >&2
    return 1
  fi
  echo "$want" >"$stamp"
}

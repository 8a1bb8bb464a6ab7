#!/usr/bin/env bash
# The tag of images built from this tree: the git revision, with -dirty
# when the tree has uncommitted changes. Never `latest`.
set -euo pipefail
cd "$(dirname "$0")/../.."
rev=$(git rev-parse --short=12 HEAD)
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then rev=$rev-dirty; fi
echo "$rev"

#!/usr/bin/env bash
# mpedu's two commands. Each one sets up what it needs first (a virtual environment
# in .venv, installed from the pinned requirements.lock), then:
#   ./run.sh train [options]   trains the LSTM language model (python -m mpedu train)
#   ./run.sh test [pytest options]   runs every test
set -euo pipefail
cd "$(dirname "$0")"

venv=.venv
stamp="$venv/.installed-$(cat requirements.lock pyproject.toml | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
    echo "mpedu: setting up $venv (first run only; about a minute)" >&2
    python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
        || { echo "mpedu: needs Python 3.10 or newer as python3" >&2; exit 1; }
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r requirements.lock
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -e .
    rm -f "$venv"/.installed-*
    touch "$stamp"
fi

command="${1:-}"
[ $# -gt 0 ] && shift
case "$command" in
    train)
        exec "$venv/bin/python" -m mpedu train "$@" ;;
    test)
        status=0
        "$venv/bin/python" -m pytest "$@" || status=$?
        if [ "$status" -eq 5 ]; then
            echo "mpedu: pytest collected no tests; the checkout looks incomplete" >&2
        fi
        exit "$status" ;;
    *)
        echo "usage: ./run.sh train [options] | ./run.sh test [pytest options]" >&2
        exit 2 ;;
esac

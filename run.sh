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

ensure_chromium() {
    # The browser test drives Debian's Chromium; never a browser downloaded by a tool.
    command -v chromium >/dev/null 2>&1 && return 0
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "mpedu: installing Debian's chromium for the browser test (about 30 s)" >&2
        apt-get update -qq >/dev/null && \
            apt-get install -y -qq --no-install-recommends chromium >/dev/null
    else
        echo "mpedu: chromium is missing; install it (sudo apt-get install chromium) or the browser test is skipped" >&2
    fi
}

command="${1:-}"
[ $# -gt 0 ] && shift
case "$command" in
    train)
        exec "$venv/bin/python" -m mpedu train "$@" ;;
    test)
        ensure_chromium || echo "mpedu: could not install chromium" >&2
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

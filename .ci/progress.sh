# Sourced by .ci/run: long quiet steps say that they are still running.

# quietly CMD...: run CMD with its stdout kept aside (its warnings and errors still show),
# printing a line every $PROGRESS_EVERY seconds (default 15) while it runs; when it fails,
# print what it wrote and fail.
quietly() {
    local log pid waited=0 every=${PROGRESS_EVERY:-15}
    log=$(mktemp)
    "$@" >"$log" &
    pid=$!
    while kill -0 "$pid" 2>/dev/null; do
        sleep 1
        waited=$((waited + 1))
        if [ $((waited % every)) -eq 0 ]; then
            echo "   ... still running (${waited} s)"
        fi
    done
    if ! wait "$pid"; then
        cat "$log" >&2
        rm -f "$log"
        return 1
    fi
    rm -f "$log"
}

# stage NAME: a header with the time of day and the seconds since the run started.
stage() {
    echo "== $1 ($(date -u +%H:%M:%S) UTC, ${SECONDS} s in)"
}

#!/usr/bin/env bash
# The fuzz campaigns of gradwire-core: every cargo-fuzz target for a bounded time, from the checked-in
# corpora (corpus/<target>/), with what each run did recorded.
#
#   fuzz.sh smoke            each target for FUZZ_SMOKE_SECONDS (default 2): CI's check (make fuzz-smoke)
#   fuzz.sh run              each target for FUZZ_SECONDS (default 600) or FUZZ_RUNS executions (default
#                            no bound), whichever comes first; results.json records executions, exec/s and crashes (make fuzz)
#   fuzz.sh cmin             merge what the runs found into corpus/<target>/, minimized (make fuzz-cmin)
#
# FUZZ_TARGETS (space-separated) picks targets; default all of `cargo fuzz list`. New inputs a run finds
# go to target/fuzz-work/<target>/ (ignored by git) and the checked-in corpus is only read, so a run
# leaves the tree clean; `cmin` is the one step that rewrites the corpus. A crash, a panic, an input
# slower than 10 s or a run past 2 GiB (a huge allocation) fails the target: the input is saved in
# artifacts/<target>/ and the script exits 1 after the other targets have run.
#
# Installs what it needs if absent: cargo-fuzz from crates.io, and a nightly toolchain (cargo-fuzz
# passes -Z flags for the sanitizer). Where no nightly can be had, the stable toolchain builds the
# targets with RUSTC_BOOTSTRAP=1, which lets it accept those flags (same compiler, same code); where
# that fails too, `smoke` says so and exits 0 so that CI does not fail on a machine without it.
set -euo pipefail
cd "$(dirname "$0")"

mode="${1:-smoke}"
triple="$(rustc -vV | sed -n 's/^host: //p')"
bin_dir="target/$triple/release"
work="target/fuzz-work"

# AddressSanitizer by default; a long campaign may pass FUZZ_SANITIZER=none for several times the
# executions per second: the crate is safe Rust but for one bounds-checked SIMD block, so what the
# targets look for (panics, overflow — debug assertions stay on —, wrong results, huge allocations,
# hangs) is caught either way.
sanitizer="${FUZZ_SANITIZER:-address}"

log() { echo "fuzz: $*" >&2; }

# cargo-fuzz 0.13 (the version the targets are written for), installed into ~/.cargo/bin once.
ensure_cargo_fuzz() {
    cargo fuzz --version >/dev/null 2>&1 && return 0
    log "installing cargo-fuzz from crates.io"
    cargo install --quiet --locked cargo-fuzz --version "^0.13" >&2
}

# Sets `toolchain` (an argument for cargo) and exports RUSTC_BOOTSTRAP where stable stands in.
choose_toolchain() {
    if cargo +nightly --version >/dev/null 2>&1; then
        toolchain="+nightly"
    elif timeout 30 rustup toolchain install nightly --profile minimal >/dev/null 2>&1; then
        toolchain="+nightly"
    else
        log "no nightly toolchain here and none can be installed: building with stable and RUSTC_BOOTSTRAP=1"
        toolchain="+stable"
        export RUSTC_BOOTSTRAP=1
    fi
}

targets() {
    if [[ -n "${FUZZ_TARGETS:-}" ]]; then
        echo "$FUZZ_TARGETS" | tr ' ' '\n'
    else
        sed -n 's/^name = "\(.*\)"$/\1/p' Cargo.toml | grep -v '^gradwire-core-fuzz$'
    fi
}

build() {
    log "building the targets ($toolchain${RUSTC_BOOTSTRAP:+, RUSTC_BOOTSTRAP=1}, sanitizer $sanitizer)"
    local out
    out="$(mktemp)"
    if ! cargo "$toolchain" fuzz build -O --sanitizer "$sanitizer" >"$out" 2>&1; then
        cat "$out" >&2
        # A compile error in the project's own code (a fuzz target or the core) is a failure, not a
        # machine without the tools: the smoke must not pass over a target that no longer builds.
        if grep -qE "could not compile \`gradwire-core(-fuzz)?\`" "$out"; then
            rm -f "$out"
            return 2
        fi
        rm -f "$out"
        return 1
    fi
    rm -f "$out"
}

# run TARGET SECONDS RUNS: one libFuzzer run; prints a JSON object of what it did.
run_target() {
    local t="$1" seconds="$2" runs="$3" out rc
    mkdir -p "$work/$t" "artifacts/$t" "corpus/$t"
    out="$(mktemp)"
    local started=$SECONDS
    set +e
    "$bin_dir/$t" "$work/$t" "corpus/$t" -max_total_time="$seconds" -runs="$runs" -timeout=10 \
        -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="artifacts/$t/" >"$out" 2>&1
    rc=$?
    set -e
    local elapsed=$((SECONDS - started))
    local execs rate rss
    execs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$out" | tail -n 1)"
    rate="$(sed -n 's/^stat::average_exec_per_sec: *//p' "$out" | tail -n 1)"
    rss="$(sed -n 's/^stat::peak_rss_mb: *//p' "$out" | tail -n 1)"
    local crash="" crashes=0
    if [[ "$rc" != 0 ]]; then
        crashes=1
        crash="$(grep -o "Test unit written to [^ ]*" "$out" | tail -n 1 | sed 's/Test unit written to //')"
        log "$t FAILED (exit $rc), input: ${crash:-none saved}; the log's end:"
        tail -n 30 "$out" >&2
    fi
    rm -f "$out"
    printf '{"target": "%s", "executions": %s, "exec_per_s": %s, "seconds": %s, "peak_rss_mb": %s, "crashes": %s, "artifact": "%s"}' \
        "$t" "${execs:-0}" "${rate:-0}" "$elapsed" "${rss:-0}" "$crashes" "$crash"
}

campaign() {
    local seconds="$1" runs="$2" record="$3" failed=0 rows=() row
    for t in $(targets); do
        row="$(run_target "$t" "$seconds" "$runs")"
        rows+=("$row")
        echo "$row"
        [[ "$row" == *'"crashes": 0'* ]] || failed=1
    done
    if [[ -n "$record" ]]; then
        {
            echo "{\"date\": \"$(date -u +%Y-%m-%dT%H:%M:%SZ)\", \"toolchain\": \"$(cargo "$toolchain" --version 2>/dev/null | head -n 1 | sed 's/"/\\"/g')\","
            echo " \"cpu\": \"$(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -n 1)\", \"sanitizer\": \"$sanitizer\","
            echo " \"max_seconds\": $seconds, \"max_runs\": $runs,"
            echo " \"targets\": ["
            local i
            for i in "${!rows[@]}"; do
                echo "  ${rows[$i]}$([[ $i -lt $((${#rows[@]} - 1)) ]] && echo ,)"
            done
            echo " ]}"
        } >"$record"
        log "recorded in $(pwd)/$record"
    fi
    return "$failed"
}

case "$mode" in
    smoke)
        if ! ensure_cargo_fuzz; then
            log "SKIPPED: cargo-fuzz could not be installed (no crates.io?); the smoke did not run"
            exit 0
        fi
        choose_toolchain
        built=0
        build || built=$?
        if [ "$built" -eq 2 ]; then
            log "FAILED: the fuzz targets do not compile (the errors above)"
            exit 1
        elif [ "$built" -ne 0 ]; then
            log "SKIPPED: the fuzz targets do not build with $toolchain on this machine; the smoke did not run"
            exit 0
        fi
        campaign "${FUZZ_SMOKE_SECONDS:-2}" -1 ""
        ;;
    run)
        ensure_cargo_fuzz
        choose_toolchain
        build
        campaign "${FUZZ_SECONDS:-600}" "${FUZZ_RUNS:--1}" "${FUZZ_RESULTS:-results.json}"
        ;;
    cmin)
        ensure_cargo_fuzz
        choose_toolchain
        for t in $(targets); do
            mkdir -p "$work/$t"
            cp -n "$work/$t"/* "corpus/$t"/ 2>/dev/null || true
            cargo "$toolchain" fuzz cmin -O "$t" "corpus/$t" >&2
        done
        ;;
    *)
        echo "usage: $0 smoke|run|cmin" >&2
        exit 2
        ;;
esac

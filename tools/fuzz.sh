#!/usr/bin/env bash
# Fuzzes every parser of untrusted bytes, one target after another, and prints a summary.
#
#   tools/fuzz.sh [SECONDS_EACH] [TARGET ...]     default: 600 s each; all targets
#
# Targets (fuzz/fuzz_targets/): gguf (GGUF header, metadata, tensor infos, then the load),
# safetensors_dir (config.json + model.safetensors header, then the load), gst_index (.gst
# header and index). Seeds come from the tests (`write_fuzz_seeds`, `write_fuzz_seed`: dense and
# mixture-of-experts models); corpora and crashes stay in fuzz/corpus and fuzz/artifacts
# (git-ignored). Needs cargo-fuzz (installed here if missing) and libFuzzer's `-Z` flags, which
# RUSTC_BOOTSTRAP=1 lets the stable compiler take. Runs one job at a time, at low priority.
# Exit status 1 if any target found a crash.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-600}; shift || true
targets=("$@"); [[ ${#targets[@]} -gt 0 ]] || targets=(gguf safetensors_dir gst_index)
export RUSTC_BOOTSTRAP=1
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz
# Seed corpora from the tests' real and tiny models.
cargo test -q --release --test bad_input write_fuzz_seeds -- --ignored >/dev/null
cargo test -q --release --lib format::tests::write_fuzz_seed -- --ignored >/dev/null
mkdir -p fuzz/logs
failed=0
printf '%-16s %8s %12s %10s %8s %6s %s\n' target seconds executions exec/s crashes slow corpus
for t in "${targets[@]}"; do
  dict=(); [[ -f fuzz/$t.dict ]] && dict=(-dict="fuzz/$t.dict")
  mkdir -p "fuzz/corpus/$t" "fuzz/artifacts/$t"
  log=fuzz/logs/$t.log
  rc=0
  nice -n 10 cargo fuzz run "$t" -- -max_total_time="$secs" -rss_limit_mb=4096 -max_len=262144 \
    -print_final_stats=1 "${dict[@]}" >"$log" 2>&1 || rc=$?
  execs=$(awk '/stat::number_of_executed_units/{print $NF}' "$log" | tail -1)
  rate=$(awk '/stat::average_exec_per_sec/{print $NF}' "$log" | tail -1)
  crashes=$(find "fuzz/artifacts/$t" -type f \( -name 'crash-*' -o -name 'oom-*' -o -name 'timeout-*' \) | wc -l)
  # Inputs over 10 s (libFuzzer's slow-unit report): not failures, but replay them
  # (`cargo fuzz run T FILE` prints the time) — a starved low-priority fuzzer also makes them.
  slow=$(find "fuzz/artifacts/$t" -type f -name 'slow-unit-*' | wc -l)
  corpus=$(find "fuzz/corpus/$t" -type f | wc -l)
  printf '%-16s %8s %12s %10s %8s %6s %s\n' "$t" "$secs" "${execs:-?}" "${rate:-?}" "$crashes" "$slow" "$corpus"
  if [[ $rc -ne 0 || $crashes -gt 0 ]]; then
    failed=1
    echo "  $t: exit $rc; see $log and fuzz/artifacts/$t/ (replay: RUSTC_BOOTSTRAP=1 cargo fuzz run $t FILE)" >&2
  fi
done
exit $failed

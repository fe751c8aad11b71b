#!/usr/bin/env bash
# The native kernels under AddressSanitizer and UndefinedBehaviorSanitizer: a separate build
# (QFSERVE_NATIVE_SANITIZE=1, kept apart from the normal one), then the kernel and model
# tests and a short served session on the default model, with Python preloading libasan (it
# is not built with it). Any report fails the run; the log is kept in $OUT (default
# sanitized.log). `make sanitize` runs it; CI's time does not fit it (about 10 minutes here).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-sanitized.log}
asan=$(gcc -print-file-name=libasan.so)
[ -f "$asan" ] || { echo "no libasan (install gcc's sanitizer runtime)"; exit 2; }
export QFSERVE_NATIVE_SANITIZE=1
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# libstdc++ too: ASan's throw interceptor must find the real __cxa_throw at start-up, and
# python3 itself does not link libstdc++ (every C++ exception would abort otherwise).
export LD_PRELOAD="$asan:$(gcc -print-file-name=libstdc++.so)"
{
  # The GPU kernels' tests are left out: they build no native code here, and the compilers
  # test_sources.py starts would inherit the preloaded runtime (and crash in it).
  python3 -m pytest -q -rs -p no:cacheprovider tests/kernels tests/engine/test_kvzip.py \
      --ignore=tests/kernels/test_sources.py --ignore=tests/kernels/test_backend.py \
      --ignore=tests/kernels/test_gpu_parity.py \
      tests/engine/test_quantized.py \
      tests/engine/test_fused.py tests/engine/test_gguf_codes.py tests/engine/test_batching.py \
      tests/kernels/test_sanitized_session.py
  echo "pytest exit status: $?"
} 2>&1 | tee "$OUT"
status=$(grep -c "ERROR: AddressSanitizer\|runtime error:" "$OUT")
if grep -q "pytest exit status: 0" "$OUT" && [ "$status" = 0 ]; then
  echo "sanitized run clean: 0 sanitizer reports"
else
  echo "sanitized run: $status sanitizer reports (see $OUT)"; exit 1
fi

#!/usr/bin/env bash
# Run one test (a pytest -k expression within a file) again and again, and count its failures
# with each failure's first assertion line (the loop that showed the template-fork race of
# test_sigterm: 2 of 20 failed before c24c8ac, 0 of 60 after). Not collected by pytest.
# LOOP_LOGS=DIR keeps each failed round's whole output there.
#
#     tests/stress/loop_test.sh tests/grading/test_grade_run.py sigterm 40
set -u
file=$1; expr=$2; rounds=${3:-20}
cd "$(dirname "$0")/../.." || exit 2
fails=0
for i in $(seq 1 "$rounds"); do
  out=$(.venv/bin/pytest -q -p no:cacheprovider "$file" -k "$expr" 2>&1)
  if echo "$out" | grep -qE "^[0-9]+ passed" && ! echo "$out" | grep -qE "[0-9]+ (failed|error)"; then
    echo "round $i ok"
  else
    fails=$((fails + 1))
    echo "round $i FAILED: $(echo "$out" | grep -m1 -E '^E .*(AssertionError|Error)' | cut -c1-600)"
    if [ -n "${LOOP_LOGS:-}" ]; then mkdir -p "$LOOP_LOGS" && echo "$out" > "$LOOP_LOGS/round-$i.log"; fi
  fi
done
echo "$file -k $expr: $fails failed of $rounds"
[ "$fails" -eq 0 ]

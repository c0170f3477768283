#!/bin/bash
# Prints PASSED <passed>/<total>; the reward is their ratio. -B: no .pyc, whose
# mtime-and-size check would miss a fix written within the second of the original.
cd "$(dirname "$0")"
out=$(python3 -B -m unittest tests.test_solution 2>&1)
total=$(echo "$out" | sed -n 's/^Ran \([0-9]*\) test.*/\1/p')
failed=$(echo "$out" | sed -n 's/.*failures=\([0-9]*\).*/\1/p')
errors=$(echo "$out" | sed -n 's/.*errors=\([0-9]*\).*/\1/p')
echo "PASSED $(( ${total:-0} - ${failed:-0} - ${errors:-0} ))/${total:-0}"

#!/bin/sh
# Every symbol libladen exports starts with laden_: nothing else leaks into
# the global namespace of the processes that load it.
set -eu
lib=${1:-build/libladen.so}
bad=$(nm -D --defined-only "$lib" | awk '$2 ~ /^[TDBRVWiu]$/ {print $3}' | grep -v '^laden_' || true)
n=$(nm -D --defined-only "$lib" | awk '$2 ~ /^[TDBRVWiu]$/' | wc -l)
if [ -n "$bad" ]; then
  echo "symbols outside the laden_ namespace in $lib:" >&2
  echo "$bad" >&2
  exit 1
fi
if [ "$n" -lt 10 ]; then
  echo "only $n symbols exported from $lib: is the API hidden?" >&2
  exit 1
fi
echo "$n exported symbols, all laden_*"

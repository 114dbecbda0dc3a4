"""Performance runs and scripts (pytest-benchmark tests, memory report); see perf/README.md."""

"""Benchmarks: side-by-side ratios measured in one run; results in bench/RESULTS.md."""

"""Benchmark drivers behind `mmjax bench ...` and the scripts in bench/."""

"""Drivers: the `mmjax` command line and the benchmarks. They import everything; nothing in the
library imports them."""

"""Equivalence, the law of cocoweave: every schedule computes what the program as written computes. `check` runs
schedules on random inputs against the reference; `compare` holds the tolerances by dtype, the error metrics and the
logical views of per-rank inputs and results that it (and the tests) compare with."""

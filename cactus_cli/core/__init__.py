"""Layer 1: pure pieces with no model in sight, by concern, bottom to top (tests/test_layout.py:
CORE_CONCERNS): basics (defaults, errors, events), io (paths, fileio, once, signals, conditions,
companions), numbers (stats, intervals), the rules (sampling, acceptance, verify, exact)."""

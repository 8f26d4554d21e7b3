"""Layer 1: pure pieces with no model in sight: errors, events, sampling, the acceptance rules, stats, paths, defaults."""

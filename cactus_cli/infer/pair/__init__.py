"""A model pair, chosen and loaded: the load plan (plan.py: every choice and its reason), the
loader (loader.py) and the cost-store key of a pair or a plan (keys.py). Above the backends and
the k policy: it asks the first what to load and hands the second its key as plain data."""

"""Real processes and values that the benchmarks and the tests share: the cache server and
``redis-server`` as child processes, a delaying TCP proxy, valid stored values.

``benchmarks/`` imports nothing from ``tests/``; the tests import these (their pytest
fixtures stay in ``tests/``, thin wrappers over the classes here).
"""

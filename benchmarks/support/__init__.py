"""Real processes and values that the benchmarks and the tests share: the cache server and
``redis-server`` as child processes, a delaying TCP proxy, valid stored values.

``benchmarks/`` imports nothing from ``tests/``; the tests import these (their pytest
fixtures stay in ``tests/``, thin wrappers over the classes here).

The parts of the larger benchmark scripts live here too, one job per module, so that no
script grows past the line limit (tests/foundation/test_layout_limits.py):
``soak_*.py`` for ``benchmarks/soak.py`` and ``cache_bench_*.py`` for
``benchmarks/cache_server.py``.
"""

"""``python -m cache_server [flags]``: the same as ``kvstash cache-server [flags]``."""

import logging

from cache_server.cli import cache_server

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cache_server(prog_name="python -m cache_server")

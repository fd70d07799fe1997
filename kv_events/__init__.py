"""KV events: what an engine's caches hold, published for routers (docs/architecture.md,
KV events). ``messages`` is the wire format, ``publisher`` the engine's side,
``follower`` a router's. Imports nothing of kvstash's: any package may use it."""

"""`kvstash router`: one OpenAI-compatible endpoint in front of N `kvstash serve` replicas
that sends each request where its prompt's KV already is (docs/serving.md, "Routing across
replicas"; issue 33).

`index` follows each replica's KV events on a thread of its own, `matching` hashes a prompt
as the engines do and finds each replica's cached prefix per tier, `choice` ranks the
replicas by expected time to first token given their queues (with a bounded imbalance),
`app` is the FastAPI app (requests forwarded through `engine.server.upstream`), `metrics`
its Prometheus counters and `cli` the command. Imports no torch (the tokenizer's loader may).
"""

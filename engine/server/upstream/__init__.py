"""What `kvstash proxy` and `kvstash router` share: both stand in front of `kvstash serve`
processes and speak only HTTP to them. `pool` keeps the engines (in flight, out for a while
after a failure), `forward` sends a request to the first engine that answers (streams passed
through), `http` the client and request-body helpers of their apps, `cli_options` the flags
and checks of their commands. Nothing here imports torch or the engine core."""

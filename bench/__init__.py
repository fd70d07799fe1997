"""`kvstash bench`: the main job. A multi-round QA workload run twice on fresh
engines, with KV offload off and on, same prompts, greedy.

Workload: `num_users` users, each with a long context of their own (random
token ids, after an optional shared system prompt), ask `num_rounds` questions
in turn. Each round's prompt is the previous prompt + the previous answer + a
new question, so every round after the first repeats a long prefix. The
engine's KV pool holds one user's longest conversation (unless
`--num-gpu-blocks` says otherwise), so by the time a user comes back the engine's own prefix cache has
lost their context: without offload it is recomputed, with offload it is loaded
from the CPU/disk (or remote) tiers.

Both engines first run the same untimed warm-up (`warmup_steps`): a conversation of
their own with the workload's prompt lengths, through every path the timed run takes
(prefill of each round's length, decode, a prefill over a GPU-cached prefix, and with
offload a CPU-tier and a disk-tier load), so round 1 compares two equally warm engines.
The engines run one after the other; the first is released before the second starts.

Outputs must be identical token for token between the two runs in float32 (a
mismatch is an error exit); in bf16/fp16 the table reports whether they are.

The package sits above `engine` (it imports `engine` and the packages below it; none of
them imports it). One module per job:

- `cli`: the click command (`kvstash bench`, attached to the root group by name);
- `settings`: flags and preset resolved to a workload, engine arguments, a model and
  the default offload tiers, before any engine starts;
- `presets`: the `--model-size` presets (8b, bench, tiny) and the Llama-3.1 config;
- `workload`: the users' conversations, the warm-up and the timed rounds on one engine;
- `runner`: both engines one after the other, then the bounds: a `BenchResult`;
- `bounds`: the host->device copy rate and each round's physical bound;
- `model_facts`: the model config, device, dtype and KV bytes per token of an engine
  not yet started;
- `results`: the data types every other module reads (`Workload`, `Turn`, `BenchResult`);
- `report`: the table, bench.json and the plot;
- `tiny_model`: random-weight checkpoints with a local tokenizer (`kvstash make-tiny-model`).

Importing the package imports none of its modules.
"""

"""`speculative bench`: our engine against Hugging Face's decoding methods, side by side in one process.

prompts.py  prompt sets (JSONL, Spec-Bench, chats) and the bundled ones: hand-written chat sets for
            instruction-tuned models, code sets cut from the toy pair's corpus
methods.py  the decoding methods under test behind one `generate(prompts)` call
timing.py   the speed bound E * T_1 / (k * T_d + T_v) and the efficiency against it
clock.py    the step times the runs paid: our engine's step records, hooks on HF's models
exactness.py  token-identity to the target's greedy output, near-ties proven
measure.py  interleaved runs: the side-by-side table of a prompt set, the k and batch sweeps
run.py      the configuration, the loaded pair, the methods and the order of the measurements
report.py / plots.py  terminal table, results.json, report.md and PNG plots
"""

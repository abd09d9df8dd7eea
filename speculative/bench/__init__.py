"""`speculative bench`: our engine against Hugging Face's decoding methods, side by side in one process.

prompts.py  prompt sets (JSONL, Spec-Bench) and the bundled sets cut from the demo corpus
methods.py  the decoding methods under test behind one `generate(prompts)` call
timing.py   step times (T_1, T_v, T_d) and the speed bound of DESIGN.md section 4
clock.py    the step times the runs paid: their own forwards and draftings, clocked
exactness.py  token-identity to the target's greedy output, near-ties proven
measure.py  interleaved runs: the side-by-side table of a prompt set, the k and batch sweeps
run.py      the configuration, the loaded pair, the methods and the order of the measurements
report.py / plots.py  terminal table, results.json, report.md and PNG plots
"""

"""verl 0.6.1 where its GPU stack is missing: on a CPU (the tests and `make demo`), and on a GPU without Transformer
Engine or SGLang (benchmarks/). verl_shims.py: its trainer's adaptations and the HF rollout; megatron_shims.py: its
Megatron workers and merger without a GPU or TE; megatron_merger: the MERGER_LAUNCHER that runs the merger with them.
docs/verl-on-cpu.md says what each adaptation works around and what a CPU run does not prove."""

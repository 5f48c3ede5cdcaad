"""Inside the Slurm job, on each node (helper_grpo_qwen3_4b.sh): the port block and address, reward GPUs, the wait
until every node joined Ray, pruning what earlier starts left, the save on preemption, verl's step lines as the
trainer writes them, and the stall watchdog. common.sh is the bash library the entry scripts source. Imports
launch.plan only."""

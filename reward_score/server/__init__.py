"""The reward model server (entry point: reward_score/reward_server.py) in parts, each importing only those before it:
settings, planner, inputs, runner, warmup, batcher, app. Each opens with what it does; README.md's Files list them."""

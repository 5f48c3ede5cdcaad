"""The reward model server in parts (entry point: reward_score/reward_server.py). Each file imports only those above:

settings.py   every setting: environment name, flag, default, checks
planner.py    the batching policy: micro-batches within the token budget, padded or packed layout (no torch)
runner.py     the model: load, format, tokenize, run a planned micro-batch, warm-up, compile, mask path
batcher.py    the GPU thread over all requests (when to launch what) and the off-loop tokenizing passes
app.py        HTTP: FastAPI app, request and response bodies, limits, auth, metrics
"""

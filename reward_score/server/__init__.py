"""The reward model server in parts (entry point: reward_score/reward_server.py). Each file imports only those above:

settings.py   every setting: environment name, flag, default, checks, --help
planner.py    the batching policy: micro-batches within the token budget, padded or packed layout (no torch)
inputs.py     a pair as token ids: TRL's formats, the chat template, tokenizing, the fit to max_length (no torch)
runner.py     the model: load, per-layer torch.compile, run a planned micro-batch (padded or packed), the mask path
warmup.py     warm-up before ready: each faster way checked against transformers' own, then the first shapes
batcher.py    the GPU thread over all requests (when to launch what) and the off-loop tokenizing passes
app.py        HTTP: FastAPI app, request and response bodies, limits, auth, metrics
"""

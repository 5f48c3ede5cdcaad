#!/usr/bin/env bash
# helper_grpo_qwen3_4b.sh: per-node helper: reward servers, Ray, the trainer.
# Not built yet: issue #8 owns it. It starts nothing and fails, so nobody mistakes it for a working job.
set -euo pipefail
echo "helper_grpo_qwen3_4b.sh is not implemented yet (issue #8); nothing was started." >&2
exit 1

"""verl reward function that calls the reward server. Not built yet: issue #3 owns it."""

raise ImportError("reward_score/safe_hack_reward_request.py is not implemented yet (issue #3)")

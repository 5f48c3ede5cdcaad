"""Reward model HTTP server. Not built yet: issue #7 owns it."""

raise SystemExit("reward_score/reward_server.py is not implemented yet (issue #7)")

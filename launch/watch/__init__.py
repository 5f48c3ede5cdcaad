"""Watching a job, running or ended, read-only: `python -m launch.watch.status` (where it is, when it ends, whether it
learns: reading.py reads the job, health.py judges it, status.py prints it; imports go that way) and the canary's
stage checks and table (CANARY=1, canary.sh). Imports launch.plan and launch.job."""

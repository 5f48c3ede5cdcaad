"""What the entry scripts run, by when and where it runs:

    launch/plan/    before the queue, on the login node (and the image's build): the settings, every refusal, the
                    preflight of verl's config, the data and the reward server; the deadline; the GPU memory plan
    launch/job/     inside the Slurm job, on each node: ports and addresses, the Ray cluster's wait, old checkpoints,
                    the stall watchdog; common.sh, the bash library the entry scripts source
    launch/watch/   watching a job, running or ended: `python -m launch.watch.status`, the canary's stage checks
    launch/merge/   the merge's checks: a merged model is complete, verl's critic save as a value model

Imports go one way: plan <- job <- watch (a phase imports only those before it); merge imports none of them
(tests/test_settings.py checks both).
"""

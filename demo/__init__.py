"""The embedded default (`make demo`) and its assets: demo data, tiny models, the trainer's stand-in. Tests and
benchmarks import the tiny models from here; the product folders (data_prep/, launch/, reward_score/) never import it."""

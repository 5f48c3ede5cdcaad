"""`make demo` and its assets: demo data, tiny models, and what verl's own trainer needs on a CPU (verl_cpu). Tests and
benchmarks import them from here; the product folders (data_prep/, launch/, reward_score/) never import it."""

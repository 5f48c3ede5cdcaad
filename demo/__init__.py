"""`make demo` and its assets: demo data and tiny models, run through the CPU layer (cpu/). Tests and benchmarks
import them from here; the product folders (data_prep/, launch/, reward_score/) never import it."""

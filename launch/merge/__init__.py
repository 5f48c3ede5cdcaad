"""The merge's checks (merge_mcore_to_hf.sh): a merged Hugging Face model is complete and computes what the
checkpoint computes, and verl's critic save becomes a value model. Imports nothing else of launch/: the merge needs
only the checkpoint."""

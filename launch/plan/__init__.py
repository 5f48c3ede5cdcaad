"""Before the queue, on the login node: the settings block read and turned into verl's trainer command, every refusal
of a setting, the preflight (verl's own config check, the data, a reward round trip), the save deadline and the GPU
memory plan; and the image's build check (verl_app.def). Imports nothing else of launch/."""

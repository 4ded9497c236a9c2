"""Loading a GLM-5.3 checkpoint: safetensors headers, the rule of what is servable, EXL3 storage
and the loader that gives a rank its slices."""

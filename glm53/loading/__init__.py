"""Loading a rank's weights: the slices the layout plan gives it (slices.py), read and built into
the model's weights (loader.py)."""

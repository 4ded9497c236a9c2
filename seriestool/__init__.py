"""The patch-series tool behind apply.py: pin, apply, check, status, export, rebase, new."""

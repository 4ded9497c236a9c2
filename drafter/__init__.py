"""drafter package."""

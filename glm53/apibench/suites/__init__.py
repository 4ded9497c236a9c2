"""The suites, each a function of the run's context that returns its part of the report."""

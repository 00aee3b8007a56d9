"""Looking inside trained runs: ``normexp analyze`` and the papers' figures (``make figure-<id>``)."""

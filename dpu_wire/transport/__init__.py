"""Data-plane transports: `base` (the interface), `tcp`, and `verbs` (pyverbs)."""

"""Reuse keyed by what a sub-job reads: input fingerprints (:mod:`.fingerprints`) and the cross-run cache (:mod:`.cache`)."""

"""Reuse keyed by what a sub-job reads: input fingerprints (:mod:`.fingerprints`) and the cross-run cache (:mod:`.cache`),
and what a succeeded run drops because only a resume would read it (:mod:`.leftovers`)."""

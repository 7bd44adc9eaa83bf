"""Reporting: the run's task timeline and its self-contained report.html (the report job assembles report.json)."""

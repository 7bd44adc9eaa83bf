"""Reporting: the run's task timeline and its offline report.html, which links the storage root's one plotly.js
(stagewise.core.assets); the report job assembles report.json."""

"""Data: column roles and feature vectors, committed preprocess manifests, the per-rank Parquet loader, demo data sets."""

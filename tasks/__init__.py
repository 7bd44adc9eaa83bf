"""Stagewise sub-jobs: plain Python, no Airflow import; each runs alone as ``python -m tasks.<stage>``."""

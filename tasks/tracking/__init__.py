"""MLflow tracking and the MLflow model registry, over the server's REST API (see api.py for why no mlflow package)."""

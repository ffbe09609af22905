"""Celery workers: each process loads the model once and feeds one engine from many task threads."""

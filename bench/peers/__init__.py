"""The peers bench_engine runs against: their runners (each run by its own venv) and `systems`."""

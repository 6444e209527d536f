"""`batchgen serve`: OpenAI's Batch and Files API on batchgen's runner (a face, like the CLI: it
may import run/, and nothing below it imports this package). `app.py` the routes and the
server, `store.py` the SQLite state, `files.py` uploads, `batches.py` a batch's checks and
counts, `worker.py` the one worker, `child.py` a batch's run in its own process."""

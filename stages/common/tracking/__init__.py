"""MLflow tracking: one run per stage execution, logged from rank 0 only.

store.py     the tracking URI, the SQLite store, the experiment and its saved view, health and access
tracker.py   the Tracker protocol stages log to: RunTracker (rank 0's run), NullTracker (none)
runs.py      opening and ending a stage's run, every node's system metrics in it
parents.py   the pipeline invocation's parent run
orphans.py   runs a killed process left RUNNING
records.py   the kinds of records and how each reaches the store (one table)
journal.py   the signed file of a run's records, and `python -m stages.common.tracking.journal resend`
sender.py    the thread that sends a journal while the stage trains
datasets.py  the run's data inputs as MLflow datasets, with their DVC hashes
models.py    a published model folder as a logged model, and a registered model version made from it
"""

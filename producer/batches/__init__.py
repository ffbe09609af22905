"""OpenAI's Batch API on the fleet: a JSONL file of requests run as ordinary jobs.

    model      Batch (OpenAI's object), BatchStatus, BatchSpec, the completion window
    store      BatchStore: one hash per batch in Redis, moved one way by a Lua script
    run        BatchRun: one batch from validating to its output files
    output     the output and error files, in line order
    driver     BatchDriver: in every API process, leases batches and runs them

docs/batch.md tells the whole story.
"""

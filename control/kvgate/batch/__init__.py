"""The Batch API (OpenAI's ``/v1/files`` and ``/v1/batches``) and its worker.

- :mod:`kvgate.batch.records`: Redis keys, the batch record and status machine, the OpenAI
  Batch object, the batch principal the worker sends lines through the gateway with
- :mod:`kvgate.batch.files`: file storage (bytes on disk, metadata in Redis)
- :mod:`kvgate.batch.jobs`: create / get / list / cancel of batches (the API's side)
- :mod:`kvgate.batch.validate`, :mod:`kvgate.batch.schedule`, :mod:`kvgate.batch.runner`: the
  worker (``kvgate batch-worker``): validation before any inference, the prefix-grouped
  schedule, execution through the gateway on spare capacity, retries, expiry, cancel

docs/batch-api.md has the operator's view.
"""

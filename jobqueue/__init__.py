"""The camera job queue on Redis, both halves: the contract (stream names, job and result fields, keys;
`job.schema.json` for producers in other languages), the producer, the consumer group's worker with its
captioners, the readers of results and feeds, fall alerts' webhook, and the Redis connection. It imports
neither the engine nor the HTTP server: camera nodes and `vlmcap worker` run without a VLM."""

"""The engine replicas behind one tokenizer service: the pool (discovery, health, load), routing
by prefix affinity bounded by load, the link to one replica (engine_client), the relay of one
request with failover, and LoRA adapter sync for a replica that joins."""

"""What the engine reports about its work: Prometheus metrics, the periodic stats line, the
`llm_request` span per request (OpenTelemetry), the recorder that feeds all three from the step
loop, and the prefix-cache event publisher (KV events)."""

"""The scheduler process: its loop, prefill and decode planning, retraction, the scheduler's
`Req` (built from the incoming message), batches and counters. It owns KV memory."""

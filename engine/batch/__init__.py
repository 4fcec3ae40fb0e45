"""What the scheduler process's layers pass each other: a request (`Req`), the batch the
scheduler picked for one step (`ScheduledBatch`), and the device tensors of one forward
(`ForwardBatch`). Plain data, below everything that reads it: memory, sampling, attention,
layers, models, the model runner and the scheduler."""

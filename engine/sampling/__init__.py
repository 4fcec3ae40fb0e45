"""Scheduler-process sampling pieces: seeded token draws, penalties, grammar matchers (whose
parse check also runs in the caller, before a request is queued)."""

"""sched-harness: record, check, replay and diff scheduler step traces."""

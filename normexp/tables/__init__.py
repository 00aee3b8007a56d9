"""Paper tables from run records (never W&B): specs, scales, planning, sweep, aggregation, rendering."""

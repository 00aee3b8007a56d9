"""Paper tables: specs (configs/table/), scales (configs/scale/), planning, the sweep, aggregation, rendering.

Run records are the only input: a table never reads W&B. ``normexp table --help`` for the command line.
"""

"""normexp's Hydra sweeper plugin: ``hydra/sweeper=table`` runs the runs of a paper table (normexp.tables)."""
